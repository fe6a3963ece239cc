"""GLM-4.5 / GLM-4.5-Air: sigmoid routing with a correction bias, an ungated shared expert,
leading dense layers, RoPE over part of each head, q/k/v biases; the multi-token-prediction
block its files carry past the layers is not run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from stratad.model.archs.base import Arch, register
from stratad.model.graph.routing import Sigmoid
from stratad.model.spec import ModelError, ModelSpec


@register
class Glm4Moe(Arch):
    name = "glm4moe"
    gguf_arch = "glm4moe"
    hf_model_types = ("glm4_moe",)
    moe = True
    attn_bias = True  # as each file states (`from_tensors`, `spec_from_hf`)
    shared_expert = True
    hf_shared = "shared_experts"
    shared_expert_gate = False
    hf_router_bias = "e_score_correction_bias"
    gguf_ffn_norm = "post_attention_norm"

    @classmethod
    def gguf_extra_blocks(cls, meta: Mapping[str, Any]) -> int:
        return int(meta.get("glm4moe.nextn_predict_layers", 0))

    @classmethod
    def spec_from_gguf(cls, meta: Mapping[str, Any], source: str) -> ModelSpec:
        spec = super().spec_from_gguf(meta, source)
        a = "glm4moe"
        gating = int(meta.get(f"{a}.expert_gating_func", 2))
        if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise ModelError(f"{source}: {a}.expert_gating_func {gating} (GLM routes by sigmoid)")
        groups = int(meta.get(f"{a}.expert_group_count", 1) or 1)
        spec = replace(
            spec,
            n_layers=spec.n_layers - cls.gguf_extra_blocks(meta),
            ffn=int(meta.get(f"{a}.feed_forward_length", 0)),
            dense_layers=int(meta.get(f"{a}.leading_dense_block_count", 0)),
            shared_expert_ffn=spec.expert_ffn * int(meta.get(f"{a}.expert_shared_count", 0)),
            rope_dim=_rope_dim(int(meta.get(f"{a}.rope.dimension_count", spec.head_dim)), spec),
            routing=Sigmoid(groups, int(meta.get(f"{a}.expert_group_used_count", groups) or 1)),
            expert_scale=float(meta.get(f"{a}.expert_weights_scale", 1.0) or 1.0),
        )
        spec.validate()
        return spec

    @classmethod
    def _gguf_norm_topk(cls, meta: Mapping[str, Any], a: str) -> bool:
        return bool(meta.get(f"{a}.expert_weights_norm", True))

    @classmethod
    def from_tensors(cls, spec: ModelSpec, names: set[str], source: str) -> ModelSpec:
        qk_norm = "head" if "blk.0.attn_q_norm.weight" in names else "none"
        return replace(spec, attn_bias="blk.0.attn_q.bias" in names, qk_norm=qk_norm)

    @classmethod
    def spec_from_hf(cls, config: Mapping[str, Any], source: str) -> ModelSpec:
        spec = super().spec_from_hf(config, source)
        params = config.get("rope_parameters") or {}
        factor = float(params.get("partial_rotary_factor")
                       or config.get("partial_rotary_factor") or 0.5)  # fmt: skip
        spec = replace(
            spec,
            ffn=int(config.get("intermediate_size") or 0),
            dense_layers=int(config.get("first_k_dense_replace", 0)),
            attn_bias=bool(config.get("attention_bias", False)),
            qk_norm="head" if config.get("use_qk_norm") else "none",
            rope_dim=_rope_dim(int(spec.head_dim * factor), spec),
        )
        spec.validate()
        return spec

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        expert_ffn = int(config["moe_intermediate_size"])
        return {
            "n_experts": int(config["n_routed_experts"]),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": expert_ffn,
            "shared_expert_ffn": expert_ffn * int(config.get("n_shared_experts", 0)),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "routing": Sigmoid(int(config.get("n_group", 1)), int(config.get("topk_group", 1))),
            "expert_scale": float(config.get("routed_scaling_factor", 1.0)),
        }


def _rope_dim(dims: int, spec: ModelSpec) -> int:
    """The rotated dims as the spec stores them: 0 when RoPE turns the whole head."""
    return 0 if dims == spec.head_dim else dims
