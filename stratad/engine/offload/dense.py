"""The dense (non-expert) weights of MoE layers, dequantized once into the compute dtype; with
`gguf`, the attention's (and linear attention's) in and out projections are held as their GGUF
blocks instead (`stratad.engine.offload.projection`): decode dots them in int8, a third of
bf16's bytes for a Q4_K_M file's types."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kernels.formats.quant import QTensor
from stratad.engine.offload.projection import (
    GgufMatrix,
    RowGroup,
    gguf_matrix,
    gguf_rows,
    split_gate_rows,
)
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelError
from stratad.model.weights import (
    AttentionWeights,
    DeltaNetWeights,
    LayerWeights,
    MlaWeights,
    MoEWeights,
)


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
    # kv_b's halves, head by head (views of the one [n_heads * (nope + value_dim), rank]):
    # the keys' [H, nope, rank], which the queries are taken through into the latent, and the
    # values' [H, value_dim, rank], which take attention's latent output back to each head's
    k_b: torch.Tensor
    v_b: torch.Tensor
    q_a_norm: torch.Tensor | None = None  # with q_b: queries through a latent
    q_b: torch.Tensor | None = None  # [n_heads * D, q_lora_rank]

    @classmethod
    def expansion(
        cls, kv_b: torch.Tensor, heads: int, nope: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_b, v_b) of kv_b [heads * (nope + value_dim), rank]."""
        per_head = kv_b.view(heads, -1, kv_b.shape[-1])
        return per_head[:, :nope], per_head[:, nope:]


@dataclass
class DenseLayer:
    attn_norm: torch.Tensor
    # [q_dim + 2 kv_dim (+ q_dim of gates: Qwen3-Next's), H], dequantized or as GGUF blocks
    qkv: torch.Tensor | GgufMatrix
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor | GgufMatrix
    ffn_norm: torch.Tensor
    router: torch.Tensor | None  # [E, H]; None: a dense feed-forward layer (`ffn`)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    shared_gate: torch.Tensor | None
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
    feed-forward block whole), dequantized once into the compute dtype; `gguf`: the attention's
    qkv and o (a linear-attention layer's in and out projections) as their GGUF blocks alone,
    where the int8 dots read every part's type (`projection.gguf_matrix`)."""

    def f(t: QTensor) -> torch.Tensor:
        return t.dequantize().to(device=device, dtype=dtype)

    def opt(t: QTensor | None) -> torch.Tensor | None:
        return None if t is None else f(t)

    def f32(t: QTensor | None) -> torch.Tensor | None:
        return None if t is None else t.dequantize().to(device=device, dtype=torch.float32)

    def held(
        tensors: Sequence[QTensor], groups: Sequence[RowGroup | None] | None = None,
        stacked: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor | GgufMatrix:  # fmt: skip
        """The projection whose rows are the tensors' (or `groups`), as GGUF blocks where
        `gguf` and every part is readable, else dequantized (`stacked`, else the tensors'
        rows concatenated)."""
        blocks = gguf_matrix(groups or [gguf_rows(t) for t in tensors], device) if gguf else None
        if blocks is not None:
            return blocks
        return stacked() if stacked is not None else torch.cat([f(t) for t in tensors])

    arch, spec = ARCHS[model.spec.arch], model.spec
    out = {}
    for i in layers:
        w = arch.layer(model, i)
        moe, a = w.mlp, w.attn
        if isinstance(a, DeltaNetWeights):
            qkv_ts, o_ts = projections(w)
            layer = DenseLayer(
                attn_norm=f(w.attn_norm), qkv=held(qkv_ts), qkv_bias=None,
                q_norm=None, k_norm=None, o=held(o_ts), ffn_norm=f(w.ffn_norm),
                router=None, shared=None, shared_gate=None,
                deltanet=DeltaNetLayer(*(t.dequantize().float().to(device)
                                         for t in (a.conv, a.dt_bias, a.a, a.norm))),
            )  # fmt: skip
        elif isinstance(a, MlaWeights):
            q_in = a.q_a if a.q_a is not None else a.q
            k_b, v_b = MlaLayer.expansion(f(a.kv_b), spec.n_heads, spec.head_dim - spec.rotary_dim)
            layer = DenseLayer(
                attn_norm=f(w.attn_norm), qkv=torch.cat([f(q_in), f(a.kv_a)]), qkv_bias=None,
                q_norm=None, k_norm=None, o=f(a.o), ffn_norm=f(w.ffn_norm), router=None,
                shared=None, shared_gate=None,
                mla=MlaLayer(q_in.shape[0], f(a.kv_a_norm), k_b, v_b, opt(a.q_a_norm),
                             f(a.q) if a.q_a is not None else None),
            )  # fmt: skip
        else:
            a = w.gqa
            biases = (a.q_bias, a.k_bias, a.v_bias)
            bias = (torch.cat([f(b) for b in biases if b is not None])
                    if a.q_bias is not None else None)  # fmt: skip
            kv_rows = [gguf_rows(a.k), gguf_rows(a.v)]
            groups: list[RowGroup | None] = [gguf_rows(a.q), *kv_rows]
            if spec.attn_gate:  # the rows as the queries, k, v, then the gates
                q_rows = groups[0]
                groups = [None] if q_rows is None else [
                    (split := split_gate_rows(q_rows, spec.n_heads))[0], *kv_rows, split[1]]

            def stacked(a: AttentionWeights = a) -> torch.Tensor:
                q, gates = _split_gates(f(a.q), spec.n_heads) if spec.attn_gate else (f(a.q), None)
                return torch.cat([q, f(a.k), f(a.v), *([gates] if gates is not None else [])])

            qkv_ts, o_ts = projections(w)
            layer = DenseLayer(
                attn_norm=f(w.attn_norm), qkv=held(qkv_ts, groups, stacked),
                qkv_bias=bias, q_norm=opt(a.q_norm), k_norm=opt(a.k_norm), o=held(o_ts),
                ffn_norm=f(w.ffn_norm), router=None, shared=None, shared_gate=None,
                o_bias=opt(a.o_bias), sinks=f32(a.sinks),
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


def projections(w: LayerWeights) -> tuple[list[QTensor], list[QTensor]]:
    """The tensors of a layer's in and out projections that `dense_layers(gguf=True)` holds as
    GGUF blocks where the int8 dots read them all (none for latent attention)."""
    a = w.attn
    if isinstance(a, DeltaNetWeights):
        return [a.qkv, a.z, a.ba], [a.out]
    if isinstance(a, MlaWeights):
        return [], []
    return [w.gqa.q, w.gqa.k, w.gqa.v], [w.gqa.o]


def blocks_saving(model: Model, layers: range, dtype_bytes: int) -> int:
    """VRAM that `dense_layers(gguf=True)` over these layers (and the output head as blocks,
    on the stage that computes the logits) saves against the dequantized copies; a tied head's
    blocks beside the embedding that one stage keeps cost their bytes."""
    arch, saved = ARCHS[model.spec.arch], 0
    for i in layers:
        for ts in projections(arch.layer(model, i)):
            if ts and all(gguf_rows(t) is not None for t in ts):
                saved += sum(math.prod(t.shape) * dtype_bytes - t.data.numel() for t in ts)
    head_name = "model.embed_tokens.weight" if model.spec.tie_embeddings else "lm_head.weight"
    head = model.tensor(head_name)
    if layers.stop == model.spec.n_layers and gguf_rows(head) is not None:
        shared = model.spec.tie_embeddings and layers.start == 0  # the embedding stays
        saved += (0 if shared else math.prod(head.shape) * dtype_bytes) - head.data.numel()
    return saved


def _split_gates(q: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated attention's q projection [heads * 2 D, H] (per head its query rows, then its
    output gate's: Qwen3-Next) as (the queries [heads D, H], the gates [heads D, H])."""
    per = q.view(heads, 2, -1, q.shape[-1])
    return per[:, 0].reshape(-1, q.shape[-1]), per[:, 1].reshape(-1, q.shape[-1])
