"""Which models the cpu engine runs in one kernel call per step, and the call's tensors.

A model whose layers are all dense llama layers runs them in `kernels.cpu.dense.DenseStack`;
one whose layers are all MoE layers with routed experts only (Qwen3-MoE: per-head q/k norms
or none) in `kernels.cpu.moe_stack.MoEStack`. Anything else (a shared expert, full-width q/k
norms, a weight the kernels do not read, mixed layers) runs layer by layer in torch
(`stratad/engine/reference/forward.py`), which defines what both compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu.dense import DenseLayer, DenseShape, DenseStack
from kernels.cpu.experts import CpuExperts
from kernels.cpu.moe_stack import MoELayer, MoEShape, MoEStack
from kernels.formats.quant import QTensor, QType
from stratad.model.graph.departure import graph_departure
from stratad.model.spec import ModelSpec
from stratad.model.weights import AttentionWeights, LayerWeights, MLPWeights, MoEWeights

Reads = Callable[[QTensor], bool]  # whether the kernels read a 2-D weight as it is


def _vector(t: QTensor | None) -> torch.Tensor | None:
    return None if t is None else t.dequantize().float().contiguous()


def _biases(a: AttentionWeights) -> tuple[torch.Tensor | None, ...]:
    return tuple(_vector(b) for b in (a.q_bias, a.k_bias, a.v_bias))


def _blocks(t: QTensor) -> tuple[torch.Tensor, QType]:
    return t.data.contiguous(), t.qtype


def dense_stack(
    kernels: CpuExperts, reads: Reads, spec: ModelSpec, layers: list[LayerWeights]
) -> DenseStack | None:
    """Every layer in one call where the model is a stack of dense layers the kernels read (no
    q/k norms, the plain graph: `stratad.model.graph.departure`); else None."""
    if spec.qk_norm != "none" or not layers or graph_departure(spec, layers) is not None:
        return None
    dense = []
    for w in layers:
        a, m = w.gqa, w.mlp
        if not isinstance(m, MLPWeights) or m.gate.shape[0] != spec.ffn:
            return None
        projections = (a.q, a.k, a.v, a.o, m.gate, m.up, m.down)
        if not all(reads(t) for t in projections):
            return None
        b = _biases(a)
        dense.append(DenseLayer(
            w.attn_norm.dequantize().float().contiguous(),
            w.ffn_norm.dequantize().float().contiguous(),
            tuple(_blocks(t) for t in projections),  # type: ignore[misc]
            (b[0], b[1], b[2]),
        ))  # fmt: skip
    shape = DenseShape(spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.ffn,
                       spec.rope_interleaved, spec.rms_eps)  # fmt: skip
    return DenseStack(kernels, shape, dense)


def _moe_reads(kernels: CpuExperts, reads: Reads, spec: ModelSpec, m: MoEWeights) -> bool:
    ex = m.experts
    stacks = (ex.gate, ex.up, ex.down)
    return (
        m.shared is None and m.shared_gate is None and reads(m.router)
        and all(t.qtype in kernels.supported and len(t.shape) == 3 for t in stacks)
        and tuple(ex.gate.shape) == (spec.n_experts, spec.expert_ffn, spec.hidden)
        and tuple(m.router.shape) == (spec.n_experts, spec.hidden)
        and spec.expert_ffn % 32 == 0 and spec.hidden % 32 == 0
    )  # fmt: skip


def one_call_moe(
    kernels: CpuExperts, reads: Reads, spec: ModelSpec, layers: list[LayerWeights]
) -> bool:
    """Whether the model is a stack of MoE layers of routed experts only (q/k norms per head or
    none, the plain graph: `stratad.model.graph.departure`) that the kernels read: what `moe_stack`
    runs in one call."""
    if spec.qk_norm not in ("none", "head") or not layers or spec.n_experts_used < 1:
        return False
    if graph_departure(spec, layers) is not None:
        return False
    for w in layers:
        a, m = w.gqa, w.mlp
        if not isinstance(m, MoEWeights) or not _moe_reads(kernels, reads, spec, m):
            return False
        if not all(reads(t) for t in (a.q, a.k, a.v, a.o)):
            return False
        if spec.qk_norm == "head" and (a.q_norm is None or a.k_norm is None):
            return False
    return True


def moe_stack(
    kernels: CpuExperts,
    reads: Reads,
    spec: ModelSpec,
    layers: list[LayerWeights],
    stacks: bool = True,
) -> MoEStack | None:
    """Every layer in one call where `one_call_moe`; else None. `stacks` False: the experts
    are addressed per expert before each call (`MoEStack.place_experts`, the expert store's),
    and the model's stacks are not read (a pack's are strided views onto its file)."""
    if not one_call_moe(kernels, reads, spec, layers):
        return None
    out = []
    for w in layers:
        a, m = w.gqa, w.mlp
        assert isinstance(m, MoEWeights)  # one_call_moe's
        head_norms = spec.qk_norm == "head"
        ex, b = m.experts, _biases(a)
        weights = (a.q, a.k, a.v, a.o, m.router)
        out.append(MoELayer(
            w.attn_norm.dequantize().float().contiguous(),
            w.ffn_norm.dequantize().float().contiguous(),
            _vector(a.q_norm) if head_norms else None,
            _vector(a.k_norm) if head_norms else None,
            (*(_blocks(t) for t in weights), *(_blocks(t) if stacks else (None, t.qtype)
                                               for t in (ex.gate, ex.up, ex.down))),
            (b[0], b[1], b[2]),
        ))  # fmt: skip
    shape = MoEShape(spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.n_experts,
                     spec.n_experts_used, spec.expert_ffn, spec.rope_interleaved,
                     spec.norm_topk_prob, spec.rms_eps)  # fmt: skip
    return MoEStack(kernels, shape, out)
