"""Per-layer weight bundles: what the forward pass reads, independent of naming."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.formats.quant import QTensor


@dataclass(frozen=True)
class AttentionWeights:
    q: QTensor  # [n_heads * D, H]
    k: QTensor  # [n_kv_heads * D, H]
    v: QTensor  # [n_kv_heads * D, H]
    o: QTensor  # [H, n_heads * D]
    q_bias: QTensor | None = None
    k_bias: QTensor | None = None
    v_bias: QTensor | None = None
    q_norm: QTensor | None = None  # [D] per head, or [n_heads * D] for the whole projection
    k_norm: QTensor | None = None


@dataclass(frozen=True)
class MLPWeights:
    gate: QTensor  # [F, H]
    up: QTensor  # [F, H]
    down: QTensor  # [H, F]


@dataclass(frozen=True)
class ExpertStack:
    """The routed experts of one layer, stacked: expert e is `gate[e]`, `up[e]`, `down[e]`."""

    gate: QTensor  # [E, F, H]
    up: QTensor  # [E, F, H]
    down: QTensor  # [E, H, F]

    def expert(self, e: int) -> MLPWeights:
        return MLPWeights(self.gate[e], self.up[e], self.down[e])


@dataclass(frozen=True)
class MoEWeights:
    router: QTensor  # [E, H]
    experts: ExpertStack
    shared: MLPWeights | None = None
    shared_gate: QTensor | None = None  # [1, H]: sigmoid gate on the shared expert
    router_bias: QTensor | None = None  # [E]: added to the scores that choose (not weigh)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: QTensor
    attn: AttentionWeights
    ffn_norm: QTensor
    mlp: MLPWeights | MoEWeights
