"""The torch-sequenced forward: the `reference` engine (float weights, any device) and the
`cpu` engine (the same layers, every product read from the GGUF blocks by the CPU kernels)."""
