"""Qwen2 dense decoders: bias on the q/k/v projections."""

from stratad.model.archs.base import Arch, register


@register
class Qwen2(Arch):
    name = "qwen2"
    gguf_arch = "qwen2"
    hf_model_types = ("qwen2",)
    attn_bias = True
