"""Qwen3 dense decoders: RMSNorm on each query and key head before RoPE."""

from stratad.model.archs.base import Arch, register


@register
class Qwen3(Arch):
    name = "qwen3"
    gguf_arch = "qwen3"
    hf_model_types = ("qwen3",)
    qk_norm = "head"
