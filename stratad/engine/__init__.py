"""The model runner: a model's forward passes over B sequences a step, each its own KV cache.

`runner.open_runner` opens one from the configuration; `reference/` is the torch forward (the
`reference` and `cpu` engines: float weights, or the GGUF blocks through the compiled CPU
kernels), `offload/` the GPU engine for MoE models larger than VRAM. Nothing here knows of
requests: `stratad.runtime` decides what each step computes.
"""
