"""Synthetic models: presets of real geometries written as GGUF files (`stratactl synth`),
the tensor types llama-quantize would give them, and random valid blocks of each type."""
