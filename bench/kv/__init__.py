"""Benchmarks of the KV cache: its RAM per parallel sequence, a quantized cache's perplexity."""
