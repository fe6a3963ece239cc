"""The offload engine: MoE models larger than the GPU, dense weights in VRAM, experts tiered
over VRAM slots, page-locked RAM and the model file (`start.open_offload` starts it)."""
