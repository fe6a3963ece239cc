"""How far a model's layer graph departs from the plain llama-style decoder: softmax-routed
(or dense) SiLU-gated feed-forward blocks without biases, RoPE over whole heads, attention
without sinks, window or output bias. The cpu engine's one-call layer stacks compute that
graph, and the compiled CPU experts (the cpu engine's one-call experts, the GPU engine's CPU
share of the misses) its feed-forward part; the reference and the GPU engine compute every
departure."""

from __future__ import annotations

from collections.abc import Sequence

from stratad.model.graph.activation import SILU
from stratad.model.graph.routing import SOFTMAX
from stratad.model.spec import ModelSpec
from stratad.model.weights import AttentionWeights, LayerWeights, MoEWeights


def ffn_departure(spec: ModelSpec, layers: Sequence[LayerWeights]) -> str | None:
    """Why a feed-forward block is not silu(gate) * up without biases (None: every one is)."""
    if spec.activation != SILU:
        return f"its experts are {spec.activation.describe()}"
    if any(isinstance(w.mlp, MoEWeights) and w.mlp.experts.biased for w in layers):
        return "its experts have biases"
    return None


def graph_departure(spec: ModelSpec, layers: Sequence[LayerWeights]) -> str | None:
    """The first departure from the plain graph, in words (None: there is none)."""
    if spec.routing != SOFTMAX or spec.expert_scale != 1.0:
        return f"it routes by {spec.routing.describe()}"
    if spec.rope_dim:
        return f"RoPE turns {spec.rope_dim} of each head's {spec.head_dim} dims"
    if spec.mla is not None:
        return f"it attends by {spec.mla.describe()}"
    if spec.deltanet is not None:
        return f"it mixes tokens by {spec.deltanet.describe()}"
    if spec.attn_gate:
        return "its attention heads' outputs are gated"
    if spec.attn_sinks or spec.sliding_window:
        return "its attention has sinks or a sliding window"
    if any(isinstance(w.attn, AttentionWeights) and w.attn.o_bias is not None for w in layers):
        return "its attention output has a bias"
    return ffn_departure(spec, layers)
