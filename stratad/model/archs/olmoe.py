"""OLMoE: RMSNorm over the whole q and k projections, softmax top-k without renormalising."""

from collections.abc import Mapping
from typing import Any

from stratad.model.archs.base import Arch, hf_key, register
from stratad.model.spec import ModelError


@register
class Olmoe(Arch):
    name = "olmoe"
    gguf_arch = "olmoe"
    hf_model_types = ("olmoe",)
    moe = True
    qk_norm = "full"

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        if config.get("clip_qkv") is not None:
            raise ModelError(f"{source}: clip_qkv is not supported")
        return {
            "n_experts": int(hf_key(config, source, "num_experts", "num_local_experts")),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        }
