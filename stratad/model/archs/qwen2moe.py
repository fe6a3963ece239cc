"""Qwen2-MoE: q/k/v bias, routed experts plus a shared expert behind a sigmoid gate."""

from collections.abc import Mapping
from typing import Any

from stratad.model.archs.base import Arch, hf_key, register


@register
class Qwen2Moe(Arch):
    name = "qwen2moe"
    gguf_arch = "qwen2moe"
    hf_model_types = ("qwen2_moe",)
    moe = True
    attn_bias = True
    shared_expert = True

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {
            "n_experts": int(hf_key(config, source, "num_experts", "num_local_experts")),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["moe_intermediate_size"]),
            "shared_expert_ffn": int(config["shared_expert_intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        }
