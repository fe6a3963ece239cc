"""Mixtral: llama attention, softmax over the top-k router logits (w1=gate, w3=up, w2=down)."""

from collections.abc import Mapping
from typing import Any

from stratad.model.archs.base import Arch, hf_key, register


@register
class Mixtral(Arch):
    name = "mixtral"
    gguf_arch = "llama"  # llama.cpp files Mixtral as llama with an expert count
    hf_model_types = ("mixtral",)
    moe = True
    gguf_rope_interleaved = True
    hf_mlp = "block_sparse_moe"
    hf_expert_proj = ("w1", "w3", "w2")

    @classmethod
    def _gguf_norm_topk(cls, meta: Mapping[str, Any], a: str) -> bool:
        return True

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {
            "n_experts": int(hf_key(config, source, "num_local_experts", "num_experts")),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["intermediate_size"]),
            "norm_topk_prob": True,
        }
