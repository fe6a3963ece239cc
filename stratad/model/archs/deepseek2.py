"""DeepSeek-V2 / V3 and Kimi K2 (`deepseek2` in GGUF; `DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`): multi-head latent attention (`stratad.model.graph.mla`), shared experts
without a gate, leading dense layers, routing by a softmax (V2) or by sigmoid scores with a
correction bias within groups (V3, Kimi), the chosen weights scaled. RoPE turns pairs
(2i, 2i + 1) of each head's rotated part, in the files of both formats.

llama.cpp's files hold the key and value expansion as two tensors per layer (`attn_k_b`
[H, rank, nope], `attn_v_b` [H, v, rank]: its cache holds the latent); older ones as one
(`attn_kv_b`). Either becomes the one `kv_b` the engines read. Their metadata states the
latent cache's head (`key_length` = rank + rope) and MLA's own in `key_length_mla`.
DeepSeek's YaRN scales the attention scores as well as the tables, in each format's own way
(`_gguf_yarn`; from config.json, mscale_all_dim as transformers does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import msgspec
import torch

from kernels.formats.quant import QTensor, QType
from stratad.model.archs.base import Arch, register
from stratad.model.graph.mla import Mla
from stratad.model.graph.rope_scaling import Yarn, yarn_mscale
from stratad.model.graph.routing import GroupedSoftmax, Routing, Sigmoid, Softmax
from stratad.model.spec import Model, ModelError, ModelSpec
from stratad.model.weights import Mixer, MlaWeights


@register
class DeepSeek2(Arch):
    name = "deepseek2"
    gguf_arch = "deepseek2"
    hf_model_types = ("deepseek_v2", "deepseek_v3", "kimi_k2")
    moe = True
    gguf_rope_interleaved = True
    shared_expert = True
    hf_shared = "shared_experts"
    shared_expert_gate = False

    @classmethod
    def spec_from_gguf(cls, meta: Mapping[str, Any], source: str) -> ModelSpec:
        spec = super().spec_from_gguf(meta, source)
        a = "deepseek2"

        def get(key: str, default: Any) -> Any:
            return meta.get(f"{a}.{key}", default)

        gating = int(get("expert_gating_func", 1) or 1)  # 1 softmax, 2 sigmoid (llama.cpp's)
        if gating not in (1, 2):
            raise ModelError(f"{source}: {a}.expert_gating_func {gating} (1 softmax, 2 sigmoid)")
        groups = int(get("expert_group_count", 1) or 1)
        used = int(get("expert_group_used_count", groups) or groups)
        spec = replace(
            spec,
            n_kv_heads=spec.n_heads,  # the expanded keys and values: every head its own
            head_dim=int(get("attention.key_length_mla", 0) or spec.head_dim),
            v_head_dim=int(get("attention.value_length_mla", 0)
                           or get("attention.value_length", spec.head_dim)),  # fmt: skip
            mla=Mla(int(get("attention.q_lora_rank", 0) or 0),
                    int(meta.get(f"{a}.attention.kv_lora_rank") or _missing(a, source)),
                    int(get("rope.dimension_count", 0))),  # fmt: skip
            ffn=int(get("feed_forward_length", 0)),
            dense_layers=int(get("leading_dense_block_count", 0)),
            shared_expert_ffn=spec.expert_ffn * int(get("expert_shared_count", 0)),
            routing=_routing(gating == 2, groups, used),
            expert_scale=float(get("expert_weights_scale", 1.0) or 1.0),
        )
        if isinstance(spec.rope_scaling, Yarn):
            spec = _gguf_yarn(spec, spec.rope_scaling, meta)
        spec.validate()
        return spec

    @classmethod
    def spec_from_hf(cls, config: Mapping[str, Any], source: str) -> ModelSpec:
        if config.get("attention_bias"):
            raise ModelError(f"{source}: attention_bias=true is not supported for deepseek2")
        spec = super().spec_from_hf(replace_keys(config), source)
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        scale = 1.0
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if isinstance(spec.rope_scaling, Yarn) and params.get("mscale_all_dim"):
            scale = yarn_mscale(spec.rope_scaling.factor, params["mscale_all_dim"]) ** 2
        spec = replace(
            spec,
            n_kv_heads=spec.n_heads,
            head_dim=nope + rope,
            v_head_dim=int(config["v_head_dim"]),
            mla=Mla(int(config.get("q_lora_rank") or 0), int(config["kv_lora_rank"]), rope),
            rope_interleaved=True,
            ffn=int(config.get("intermediate_size") or 0),
            dense_layers=int(config.get("first_k_dense_replace", 0)),
            attn_scale=scale,
        )
        spec.validate()
        return spec

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        expert_ffn = int(config["moe_intermediate_size"])
        groups = int(config.get("n_group") or 1)
        # V2 names its method (a softmax, greedy or within groups); V3 and Kimi K2 route by
        # sigmoid scores with the correction bias within groups (noaux_tc)
        v2 = config.get("model_type") == "deepseek_v2"
        method = config.get("topk_method") or ("greedy" if v2 else "noaux_tc")
        sigmoid = method == "noaux_tc" or config.get("scoring_func") == "sigmoid"
        if not sigmoid and method not in ("greedy", "group_limited_greedy"):
            raise ModelError(f"{source}: topk_method {method!r} is not supported")
        return {
            "n_experts": int(config["n_routed_experts"]),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": expert_ffn,
            "shared_expert_ffn": expert_ffn * int(config.get("n_shared_experts") or 0),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "routing": _routing(sigmoid, 1 if method == "greedy" else groups,
                                int(config.get("topk_group") or groups)),  # fmt: skip
            "expert_scale": float(config.get("routed_scaling_factor", 1.0)),
        }

    @classmethod
    def router_bias_name(cls, spec: ModelSpec) -> str:
        return "e_score_correction_bias" if isinstance(spec.routing, Sigmoid) else ""

    @classmethod
    def gguf_names(cls, spec: ModelSpec) -> dict[str, str]:
        names = super().gguf_names(spec)
        for i in range(spec.n_layers):
            blk, attn = f"blk.{i}", f"model.layers.{i}.self_attn"
            names |= {
                f"{blk}.attn_q_a.weight": f"{attn}.q_a_proj.weight",
                f"{blk}.attn_q_a_norm.weight": f"{attn}.q_a_layernorm.weight",
                f"{blk}.attn_q_b.weight": f"{attn}.q_b_proj.weight",
                f"{blk}.attn_kv_a_mqa.weight": f"{attn}.kv_a_proj_with_mqa.weight",
                f"{blk}.attn_kv_a_norm.weight": f"{attn}.kv_a_layernorm.weight",
                f"{blk}.attn_kv_b.weight": f"{attn}.kv_b_proj.weight",
                f"{blk}.attn_k_b.weight": f"{attn}.k_b_proj.weight",
                f"{blk}.attn_v_b.weight": f"{attn}.v_b_proj.weight",
            }
        return names

    @classmethod
    def attention(cls, model: Model, i: int) -> Mixer:
        spec, t = model.spec, model.tensor
        assert spec.mla is not None
        attn = f"model.layers.{i}.self_attn"
        lora = spec.mla.q_lora_rank
        return MlaWeights(
            q=t(f"{attn}.q_b_proj.weight" if lora else f"{attn}.q_proj.weight"),
            kv_a=t(f"{attn}.kv_a_proj_with_mqa.weight"),
            kv_a_norm=t(f"{attn}.kv_a_layernorm.weight"),
            kv_b=_kv_b(model, attn),
            o=t(f"{attn}.o_proj.weight"),
            q_a=t(f"{attn}.q_a_proj.weight") if lora else None,
            q_a_norm=t(f"{attn}.q_a_layernorm.weight") if lora else None,
        )


def replace_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json as the llama-style reader takes it: MLA expands to a key and value head
    per query head (the files' num_key_value_heads is the heads)."""
    return {**config, "num_key_value_heads": config["num_attention_heads"]}


def _kv_b(model: Model, attn: str) -> QTensor:
    """The key and value expansion [H * (nope + v), rank]: as stored, or from llama.cpp's
    two halves (k_b [H, rank, nope], v_b [H, v, rank]), head by head."""
    whole = model.tensors.get(f"{attn}.kv_b_proj.weight")
    if whole is not None:
        return whole
    k_b = model.tensor(f"{attn}.k_b_proj.weight").dequantize()
    v_b = model.tensor(f"{attn}.v_b_proj.weight").dequantize()
    both = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, rank]
    rows = both.reshape(-1, both.shape[-1]).contiguous()
    return QTensor(rows, QType.F32, tuple(rows.shape))


def _gguf_yarn(spec: ModelSpec, yarn: Yarn, meta: Mapping[str, Any]) -> ModelSpec:
    """DeepSeek's YaRN as llama.cpp computes it from a GGUF file: the file's attn_factor a
    on the tables (times YaRN's own mscale where the file has no log multiplier), and the
    scores times (a * mscale(factor, m))^2, m the mscale_all_dim that the converter stores as
    yarn_log_multiplier / 0.1."""
    key = "deepseek2.rope.scaling"
    a = float(meta.get(f"{key}.attn_factor", 1.0) or 1.0)
    m = float(meta.get(f"{key}.yarn_log_multiplier", 0.0) or 0.0) / 0.1
    tables = a if m else a * yarn_mscale(yarn.factor)
    scores = a * yarn_mscale(yarn.factor, m if m else 1.0)
    return replace(spec, rope_scaling=msgspec.structs.replace(yarn, attn_factor=tables),
                   attn_scale=scores**2)  # fmt: skip


def _routing(sigmoid: bool, groups: int, used: int) -> Routing:
    if sigmoid:
        return Sigmoid(groups, used)
    return GroupedSoftmax(groups, used) if used < groups else Softmax()


def _missing(a: str, source: str) -> int:
    raise ModelError(f"{source}: missing metadata key '{a}.attention.kv_lora_rank'")
