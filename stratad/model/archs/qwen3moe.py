"""Qwen3-MoE: Qwen3 attention, softmax top-k routing renormalised over the chosen experts."""

from collections.abc import Mapping
from typing import Any

from stratad.model.archs.base import Arch, hf_key, register


@register
class Qwen3Moe(Arch):
    name = "qwen3moe"
    gguf_arch = "qwen3moe"
    hf_model_types = ("qwen3_moe",)
    moe = True
    qk_norm = "head"

    @classmethod
    def _gguf_norm_topk(cls, meta: Mapping[str, Any], a: str) -> bool:
        return True  # llama.cpp always renormalises for qwen3moe

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {
            "n_experts": int(hf_key(config, source, "num_experts", "num_local_experts")),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["moe_intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        }
