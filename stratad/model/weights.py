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
    o_bias: QTensor | None = None  # [H]
    sinks: QTensor | None = None  # [n_heads]: each head's sink logit (spec.attn_sinks)


@dataclass(frozen=True)
class MlaWeights:
    """Multi-head latent attention's projections (`stratad.model.graph.mla`)."""

    q: QTensor  # [n_heads * D, H], or q_b [n_heads * D, q_lora_rank] after q_a and its norm
    kv_a: QTensor  # [kv_lora_rank + rope_dim, H]: the latent, then the shared rotated key
    kv_a_norm: QTensor  # [kv_lora_rank]
    kv_b: QTensor  # [n_heads * (D - rope_dim + value_dim), kv_lora_rank]: per head k, then v
    o: QTensor  # [H, n_heads * value_dim]
    q_a: QTensor | None = None  # [q_lora_rank, H]
    q_a_norm: QTensor | None = None  # [q_lora_rank]


@dataclass(frozen=True)
class DeltaNetWeights:
    """A Gated DeltaNet layer's weights (`stratad.model.graph.deltanet`), in llama.cpp's layout."""

    qkv: QTensor  # [2 key_dim + value_dim, H]: every head's q, then k, then v
    z: QTensor  # [value_dim, H]: the output gate
    ba: QTensor  # [2 v_heads, H]: per key head, its value heads' beta logits, then alphas
    conv: QTensor  # [conv_dim, conv_kernel]: depthwise, causal
    dt_bias: QTensor  # [v_heads]
    a: QTensor  # [v_heads]: -exp(A_log), the decay's rate (negative)
    norm: QTensor  # [v_dim]
    out: QTensor  # [H, value_dim]


# how a layer mixes tokens: attention, latent attention, or linear attention
Mixer = AttentionWeights | MlaWeights | DeltaNetWeights


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
    gate_bias: QTensor | None = None  # [E, F] (gpt-oss): expert e's biases are row e
    up_bias: QTensor | None = None  # [E, F]
    down_bias: QTensor | None = None  # [E, H]

    def expert(self, e: int) -> MLPWeights:
        return MLPWeights(self.gate[e], self.up[e], self.down[e])

    @property
    def biased(self) -> bool:
        return self.down_bias is not None


@dataclass(frozen=True)
class MoEWeights:
    router: QTensor  # [E, H]
    experts: ExpertStack
    shared: MLPWeights | None = None
    shared_gate: QTensor | None = None  # [1, H]: sigmoid gate on the shared expert
    router_bias: QTensor | None = None  # [E]: as the spec's routing adds it (`choose`)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: QTensor
    attn: Mixer
    ffn_norm: QTensor
    mlp: MLPWeights | MoEWeights

    @property
    def gqa(self) -> AttentionWeights:
        """The attention's q/k/v projections, for the paths that compute only that form (the
        fast paths refuse multi-head latent attention before reaching them)."""
        if not isinstance(self.attn, AttentionWeights):
            raise TypeError(f"{type(self.attn).__name__} has no q/k/v projections")
        return self.attn
