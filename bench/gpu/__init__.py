"""Benchmarks of the offload engine on a GPU: end to end, batched, speculation, MoE kernels."""
