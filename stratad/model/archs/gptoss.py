"""gpt-oss (20b, 120b): attention with a learned sink per head and a sliding window on every
other layer, biases on every projection, routing by a softmax over the top k logits, and
experts of a clamped SwiGLU with biases. Hugging Face stores each layer's experts fused
and transposed (`gate_up_proj` [E, H, 2F] with gate and up interleaved), or, as the published
checkpoints do, as MXFP4 blocks and scales (read into GGUF's MXFP4 encoding, bit for bit the
same values); they are split into the stacked form the engines read."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from kernels.formats.mxfp4_packed import mxfp4_from_blocks
from kernels.formats.quant import QTensor
from stratad.model.archs.base import Arch, register
from stratad.model.graph.activation import ClampedSwiGlu
from stratad.model.graph.routing import TopKSoftmax
from stratad.model.spec import ModelError, ModelSpec

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_PACKED = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$"
)


@register
class GptOss(Arch):
    name = "gpt-oss"
    gguf_arch = "gpt-oss"
    hf_model_types = ("gpt_oss",)
    moe = True
    attn_bias = True
    o_bias = True
    expert_bias = True
    hf_router = "router"
    hf_router_bias = "bias"
    gguf_ffn_norm = "post_attention_norm"

    @classmethod
    def spec_from_gguf(cls, meta: Mapping[str, Any], source: str) -> ModelSpec:
        spec = super().spec_from_gguf(meta, source)
        window = int(meta.get("gpt-oss.attention.sliding_window", 0))
        return _gpt_oss(spec, window, ClampedSwiGlu())  # llama.cpp's swiglu_oai constants

    @classmethod
    def spec_from_hf(cls, config: Mapping[str, Any], source: str) -> ModelSpec:
        spec = super().spec_from_hf(config, source)
        n = spec.n_layers
        want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if list(config.get("layer_types") or want) != want:
            raise ModelError(f"{source}: layer_types other than sliding/full alternating")
        act = ClampedSwiGlu(float(config.get("swiglu_alpha", 1.702)),
                            float(config.get("swiglu_limit", 7.0)))  # fmt: skip
        return _gpt_oss(replace(spec, attn_bias=bool(config.get("attention_bias", True))),
                        int(config.get("sliding_window") or 0), act)  # fmt: skip

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {
            "n_experts": int(config["num_local_experts"]),
            "n_experts_used": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["intermediate_size"]),
        }

    @classmethod
    def hf_tensors(
        cls, raw: dict[str, torch.Tensor], spec: ModelSpec, source: str
    ) -> Mapping[str, torch.Tensor | QTensor]:
        out = {}
        for name, t in raw.items():
            m = _FUSED.match(name)
            if _PACKED.match(name):
                continue  # read in pairs below
            if m is None:
                out[name] = t
                continue
            ex, kind, bias = m.group(1), m.group(2), m.group(3)
            if kind == "down_proj":  # [E, F, H] -> [E, H, F]; its bias [E, H] as it is
                out[f"{ex}.down_proj{bias or ''}"] = t if bias else t.transpose(1, 2)
            elif bias:  # [E, 2F], gate and up interleaved
                out[f"{ex}.gate_proj_bias"], out[f"{ex}.up_proj_bias"] = t[:, ::2], t[:, 1::2]
            else:  # [E, H, 2F] -> gate and up [E, F, H]
                out[f"{ex}.gate_proj"] = t[..., ::2].transpose(1, 2)
                out[f"{ex}.up_proj"] = t[..., 1::2].transpose(1, 2)
        packed = _packed_experts(raw, source)
        return {n: t.contiguous() for n, t in out.items()} | packed

    @classmethod
    def hf_expert_names(cls, spec: ModelSpec, layer: int) -> dict[str, str]:
        return {}  # stacked already (`hf_tensors`)


def _packed_experts(raw: Mapping[str, torch.Tensor], source: str) -> dict[str, QTensor]:
    """The experts a published checkpoint holds as MXFP4 (`{proj}_blocks` [E, R, G, 16] and
    `{proj}_scales` [E, R, G], R the output rows, gate's and up's interleaved), stacked as
    the engines read them, in GGUF's encoding."""
    out = {}
    for name, blocks in raw.items():
        m = _PACKED.match(name)
        if m is None or m.group(3) != "blocks":
            continue
        ex, kind = m.group(1), m.group(2)
        scales = raw.get(f"{ex}.{kind}_scales")
        if scales is None:
            raise ModelError(f"{source}: {name} has no {kind}_scales beside it")
        try:
            t = mxfp4_from_blocks(blocks, scales, f"{source}: {ex}.{kind}")
        except ValueError as err:
            raise ModelError(str(err)) from None
        if kind == "down_proj":  # [E, H, F] as the engines read it
            out[f"{ex}.down_proj"] = t
            continue
        n, rows, cols = t.shape  # rows 2f and 2f + 1: gate's and up's row f
        for half, proj in enumerate(("gate_proj", "up_proj")):
            out[f"{ex}.{proj}"] = QTensor(t.data[:, half::2].contiguous(), t.qtype,
                                          (n, rows // 2, cols))  # fmt: skip
    for name in raw:
        m = _PACKED.match(name)
        lone = m is not None and m.group(3) == "scales"
        if m is not None and lone and f"{m.group(1)}.{m.group(2)}_blocks" not in raw:
            raise ModelError(f"{source}: {name} has no {m.group(2)}_blocks beside it")
    return out


def _gpt_oss(spec: ModelSpec, window: int, act: ClampedSwiGlu) -> ModelSpec:
    spec = replace(spec, routing=TopKSoftmax(), norm_topk_prob=False, activation=act,
                   attn_sinks=True, sliding_window=window,
                   swa_pattern=2 if window else 0)  # fmt: skip
    spec.validate()
    return spec
