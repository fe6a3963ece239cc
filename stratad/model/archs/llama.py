"""Llama (and SmolLM2, Mistral-style) dense decoders."""

from stratad.model.archs.base import Arch, register


@register
class Llama(Arch):
    name = "llama"
    gguf_arch = "llama"
    hf_model_types = ("llama", "mistral")
    gguf_rope_interleaved = True  # llama.cpp's converter permutes q/k rows for pair-wise RoPE
