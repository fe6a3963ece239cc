"""Qwen3-Next (`qwen3next` in GGUF; `Qwen3NextForCausalLM`): Gated DeltaNet linear attention
in three of every four layers (`stratad.model.graph.deltanet`), full attention in the fourth with a
sigmoid gate on each head's output (q's projection gives both, per head) and RoPE over a
quarter of each head; routed experts plus a shared expert behind a sigmoid gate.

The engines read llama.cpp's layout; a Hugging Face checkpoint is put into it at load as
llama.cpp's converter does: `in_proj_qkvz` (q, k, v, z grouped by key head) split into
every head's q, k, v and the gate z apart, the conv's [C, 1, K] squeezed, A_log as
-exp(A_log), and each RMSNorm's weight w stored as 1 + w (the checkpoint's norms scale by
1 + w; not the DeltaNet's output norm, which scales by w).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from stratad.model.archs.base import Arch, hf_key, register
from stratad.model.graph.deltanet import GatedDeltaNet
from stratad.model.spec import Model, ModelError, ModelSpec
from stratad.model.weights import DeltaNetWeights, Mixer

_QKVZ = re.compile(r"(model\.layers\.\d+\.linear_attn)\.in_proj_qkvz\.weight$")


@register
class Qwen3Next(Arch):
    name = "qwen3next"
    gguf_arch = "qwen3next"
    hf_model_types = ("qwen3_next",)
    moe = True
    qk_norm = "head"
    shared_expert = True
    gguf_ffn_norm = "post_attention_norm"

    @classmethod
    def spec_from_gguf(cls, meta: Mapping[str, Any], source: str) -> ModelSpec:
        spec = super().spec_from_gguf(meta, source)
        a = "qwen3next"

        def need(key: str) -> int:
            if f"{a}.{key}" not in meta:
                raise ModelError(f"{source}: missing metadata key '{a}.{key}'")
            return int(meta[f"{a}.{key}"])

        v_heads = need("ssm.time_step_rank")
        net = GatedDeltaNet(
            k_heads=need("ssm.group_count"), v_heads=v_heads, k_dim=need("ssm.state_size"),
            v_dim=need("ssm.inner_size") // v_heads, conv_kernel=need("ssm.conv_kernel"),
            interval=int(meta.get(f"{a}.full_attention_interval", 4)),
        )  # fmt: skip
        return _qwen3next(spec, net, int(meta.get(f"{a}.rope.dimension_count", 0)))

    @classmethod
    def _gguf_norm_topk(cls, meta: Mapping[str, Any], a: str) -> bool:
        return True  # llama.cpp renormalises the chosen weights (norm_topk_prob in every file)

    @classmethod
    def spec_from_hf(cls, config: Mapping[str, Any], source: str) -> ModelSpec:
        interval = int(config.get("full_attention_interval") or 4)
        types = config.get("layer_types")
        if types is not None and any(
            (t == "full_attention") != (i % interval == interval - 1) for i, t in enumerate(types)
        ):
            raise ModelError(f"{source}: layer_types is not full attention every {interval}"
                             " layers")  # fmt: skip
        spec = super().spec_from_hf(config, source)
        net = GatedDeltaNet(
            k_heads=int(config["linear_num_key_heads"]),
            v_heads=int(config["linear_num_value_heads"]),
            k_dim=int(config["linear_key_head_dim"]), v_dim=int(config["linear_value_head_dim"]),
            conv_kernel=int(config["linear_conv_kernel_dim"]), interval=interval,
        )  # fmt: skip
        params = config.get("rope_parameters") or {}
        factor = float(params.get("partial_rotary_factor")
                       or config.get("partial_rotary_factor") or 0.25)  # fmt: skip
        return _qwen3next(spec, net, int(spec.head_dim * factor))

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {
            "n_experts": int(hf_key(config, source, "num_experts")),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["moe_intermediate_size"]),
            "shared_expert_ffn": int(config["shared_expert_intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        }

    @classmethod
    def hf_tensors(
        cls, raw: dict[str, torch.Tensor], spec: ModelSpec, source: str
    ) -> dict[str, torch.Tensor]:
        net = spec.deltanet
        assert net is not None
        out = {}
        for name, t in raw.items():
            m = _QKVZ.match(name)
            if m is not None:
                qkv, z = _split_qkvz(t, net)
                out[f"{m.group(1)}.in_proj_qkv.weight"], out[f"{m.group(1)}.in_proj_z.weight"] = (
                    qkv, z)  # fmt: skip
            elif name.endswith(".conv1d.weight"):
                out[name] = t.reshape(t.shape[0], -1)
            elif name.endswith(".A_log"):
                out[name[: -len("A_log")] + "a"] = -torch.exp(t.float()).to(t.dtype)
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                out[name] = t + 1  # the checkpoint's norms scale by 1 + w
            else:
                out[name] = t
        return out

    @classmethod
    def gguf_names(cls, spec: ModelSpec) -> dict[str, str]:
        names = super().gguf_names(spec)
        for i in range(spec.n_layers):
            blk, la = f"blk.{i}", f"model.layers.{i}.linear_attn"
            names |= {
                f"{blk}.attn_qkv.weight": f"{la}.in_proj_qkv.weight",
                f"{blk}.attn_gate.weight": f"{la}.in_proj_z.weight",
                f"{blk}.ssm_ba.weight": f"{la}.in_proj_ba.weight",
                f"{blk}.ssm_conv1d.weight": f"{la}.conv1d.weight",
                f"{blk}.ssm_dt.bias": f"{la}.dt_bias",
                f"{blk}.ssm_a": f"{la}.a",
                f"{blk}.ssm_norm.weight": f"{la}.norm.weight",
                f"{blk}.ssm_out.weight": f"{la}.out_proj.weight",
            }
        return names

    @classmethod
    def attention(cls, model: Model, i: int) -> Mixer:
        if not model.spec.linear_layer(i):
            return super().attention(model, i)
        t, la = model.tensor, f"model.layers.{i}.linear_attn"
        return DeltaNetWeights(
            qkv=t(f"{la}.in_proj_qkv.weight"), z=t(f"{la}.in_proj_z.weight"),
            ba=t(f"{la}.in_proj_ba.weight"), conv=t(f"{la}.conv1d.weight"),
            dt_bias=t(f"{la}.dt_bias"), a=t(f"{la}.a"), norm=t(f"{la}.norm.weight"),
            out=t(f"{la}.out_proj.weight"),
        )  # fmt: skip


def _qwen3next(spec: ModelSpec, net: GatedDeltaNet, rope_dims: int) -> ModelSpec:
    spec = replace(spec, deltanet=net, attn_gate=True, qk_norm="head",
                   rope_dim=0 if rope_dims == spec.head_dim else rope_dims)  # fmt: skip
    spec.validate()
    return spec


def _split_qkvz(w: torch.Tensor, net: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz [per key head: q, k, v, z] -> (every head's q, k, v; every head's z), as
    llama.cpp's converter reorders it."""
    r = net.v_heads // net.k_heads
    per = w.view(net.k_heads, 2 * net.k_dim + 2 * r * net.v_dim, w.shape[-1])
    q, k, v, z = per.split([net.k_dim, net.k_dim, r * net.v_dim, r * net.v_dim], dim=1)
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v)]
    return torch.cat(flat).contiguous(), z.reshape(-1, w.shape[-1]).contiguous()
