"""The dense (non-expert) weights of MoE layers, dequantized once into the compute dtype, and
(benchmarks only for now) a second copy of the attention projections as their GGUF blocks,
which a decode pass dots in int8 (`kernels.layers.qlinear`): a third of bf16's bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kernels.experts.moe_dots_q8 import Q8_DOT_QTYPES
from kernels.formats.quant import QTensor, QType
from kernels.layers.qlinear import QLinearConfig, qlinear
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelError
from stratad.model.weights import DeltaNetWeights, MlaWeights, MoEWeights


@dataclass(frozen=True)
class GgufMatrix:
    """A dense projection as GGUF blocks: runs of rows of one type each ([rows, row bytes] on
    the device), stacked as the bf16 matrix stacks them."""

    parts: tuple[tuple[torch.Tensor, QType], ...]

    def __call__(self, x: torch.Tensor, config: QLinearConfig) -> torch.Tensor:
        """x [T, K] @ the matrix^T -> [T, N], x's rows dotted as their Q8 rows."""
        outs = [qlinear(x, blocks, qtype, config) for blocks, qtype in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def gguf_matrix(tensors: Sequence[QTensor], device: torch.device) -> GgufMatrix | None:
    """The tensors' rows stacked in order (consecutive tensors of one type share a run), or
    None where a type has no int8 reader."""
    if any(t.qtype not in Q8_DOT_QTYPES or len(t.shape) != 2 for t in tensors):
        return None
    runs: list[tuple[list[torch.Tensor], QType]] = []
    for t in tensors:
        rows = t.data.reshape(t.shape[0], -1)
        if runs and runs[-1][1] == t.qtype:
            runs[-1][0].append(rows)
        else:
            runs.append(([rows], t.qtype))
    return GgufMatrix(tuple((torch.cat(r).to(device).contiguous(), q) for r, q in runs))


@dataclass(frozen=True)
class DeltaNetLayer:
    """A Gated DeltaNet layer's own weights, float32 (`stratad.model.graph.deltanet`); its
    projections are the layer's `qkv` (q, k, v, then z and ba) and `o`."""

    conv: torch.Tensor  # [conv_dim, conv_kernel]
    dt_bias: torch.Tensor  # [Hv]
    a: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [Dv]


@dataclass(frozen=True)
class MlaLayer:
    """Multi-head latent attention's weights past its first products (`stratad.model.graph.mla`;
    the layer's `qkv` is q's input projection, q_a or q itself, then kv_a)."""

    q_in: int  # rows of qkv that are q's (q_lora_rank, or every head's query)
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [n_heads * (D - rope_dim + value_dim), kv_lora_rank]
    q_a_norm: torch.Tensor | None = None  # with q_b: queries through a latent
    q_b: torch.Tensor | None = None  # [n_heads * D, q_lora_rank]


@dataclass
class DenseLayer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [q_dim + 2 kv_dim (+ q_dim of gates: Qwen3-Next's), H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ffn_norm: torch.Tensor
    router: torch.Tensor | None  # [E, H]; None: a dense feed-forward layer (`ffn`)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    shared_gate: torch.Tensor | None
    # qkv and o as GGUF blocks for decode (`gguf_matrix`; None: bf16 only)
    qkv_gguf: GgufMatrix | None = None
    o_gguf: GgufMatrix | None = None
    # gpt-oss: the output projection's bias, each query head's sink logit (float32 [Hq]), the
    # router's bias, and the routed experts' biases, float32 (gate and up [E, 2, F], down
    # [E, H]) as the fused kernels read them
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    expert_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # a leading dense layer's feed-forward block (GLM-4.5's first): gate, up [F, H], down
    ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # a linear-attention layer's (Qwen3-Next's): then qkv is its in-projection, o its out
    deltanet: DeltaNetLayer | None = None
    # multi-head latent attention's (DeepSeek's): then qkv is q's input and kv_a
    mla: MlaLayer | None = None


def dense_layers(
    model: Model, device: torch.device, dtype: torch.dtype, layers: range, gguf: bool = False
) -> dict[int, DenseLayer]:
    """Everything but the routed experts of these layers (a leading dense layer's
    feed-forward block whole), dequantized once into the compute dtype; `gguf`: also qkv and o
    as their GGUF blocks where the int8 readers take them."""

    def f(t: QTensor) -> torch.Tensor:
        return t.dequantize().to(device=device, dtype=dtype)

    def opt(t: QTensor | None) -> torch.Tensor | None:
        return None if t is None else f(t)

    def f32(t: QTensor | None) -> torch.Tensor | None:
        return None if t is None else t.dequantize().to(device=device, dtype=torch.float32)

    arch, spec = ARCHS[model.spec.arch], model.spec
    out = {}
    for i in layers:
        w = arch.layer(model, i)
        moe, a = w.mlp, w.attn
        if isinstance(a, DeltaNetWeights):
            layer = DenseLayer(
                attn_norm=f(w.attn_norm), qkv=torch.cat([f(a.qkv), f(a.z), f(a.ba)]),
                qkv_bias=None, q_norm=None, k_norm=None, o=f(a.out), ffn_norm=f(w.ffn_norm),
                router=None, shared=None, shared_gate=None,
                deltanet=DeltaNetLayer(*(t.dequantize().float().to(device)
                                         for t in (a.conv, a.dt_bias, a.a, a.norm))),
            )  # fmt: skip
        elif isinstance(a, MlaWeights):
            q_in = a.q_a if a.q_a is not None else a.q
            layer = DenseLayer(
                attn_norm=f(w.attn_norm), qkv=torch.cat([f(q_in), f(a.kv_a)]), qkv_bias=None,
                q_norm=None, k_norm=None, o=f(a.o), ffn_norm=f(w.ffn_norm), router=None,
                shared=None, shared_gate=None,
                mla=MlaLayer(q_in.shape[0], f(a.kv_a_norm), f(a.kv_b), opt(a.q_a_norm),
                             f(a.q) if a.q_a is not None else None),
            )  # fmt: skip
        else:
            a = w.gqa
            biases = (a.q_bias, a.k_bias, a.v_bias)
            bias = (torch.cat([f(b) for b in biases if b is not None])
                    if a.q_bias is not None else None)  # fmt: skip
            q, gates = _split_gates(f(a.q), spec.n_heads) if spec.attn_gate else (f(a.q), None)
            layer = DenseLayer(
                attn_norm=f(w.attn_norm),
                qkv=torch.cat([q, f(a.k), f(a.v), *([gates] if gates is not None else [])]),
                qkv_bias=bias, q_norm=opt(a.q_norm), k_norm=opt(a.k_norm), o=f(a.o),
                ffn_norm=f(w.ffn_norm), router=None, shared=None, shared_gate=None,
                qkv_gguf=gguf_matrix([a.q, a.k, a.v], device) if gguf and gates is None else None,
                o_gguf=gguf_matrix([a.o], device) if gguf else None, o_bias=opt(a.o_bias),
                sinks=f32(a.sinks),
            )  # fmt: skip
        if not isinstance(moe, MoEWeights):
            if model.spec.moe_layer(i):
                raise ModelError(f"{model.source}: layer {i} has no routed experts")
            out[i] = replace(layer, ffn=(f(moe.gate), f(moe.up), f(moe.down)))
            continue
        shared, experts = moe.shared, moe.experts
        expert_bias = None
        if experts.gate_bias is not None and experts.up_bias is not None:
            gate_up = torch.stack([experts.gate_bias.dequantize(), experts.up_bias.dequantize()], 1)
            down = f32(experts.down_bias)
            if down is None:
                raise ModelError(f"{model.source}: layer {i}'s experts have gate and up biases"
                                 " but no down bias")  # fmt: skip
            expert_bias = (gate_up.to(device=device, dtype=torch.float32).contiguous(), down)
        out[i] = replace(
            layer,
            router=f(moe.router),
            shared=(f(shared.gate), f(shared.up), f(shared.down)) if shared else None,
            shared_gate=opt(moe.shared_gate),
            router_bias=f32(moe.router_bias),
            expert_bias=expert_bias,
        )
    return out


def _split_gates(q: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated attention's q projection [heads * 2 D, H] (per head its query rows, then its
    output gate's: Qwen3-Next) as (the queries [heads D, H], the gates [heads D, H])."""
    per = q.view(heads, 2, -1, q.shape[-1])
    return per[:, 0].reshape(-1, q.shape[-1]), per[:, 1].reshape(-1, q.shape[-1])
