"""The shape a spec implies for every weight, checked when a model loads.

A file states its hyper-parameters and each tensor's shape and type separately; where they
disagree (an expert count that is not the experts stacked, a type id that changes a tensor's
size) a kernel would read past a buffer. Loading checks every layer's weights against the
spec before anything reads through them, naming the first tensor at fault.
"""

from __future__ import annotations

from collections.abc import Callable

from kernels.formats.quant import QTensor
from stratad.model.spec import Model, ModelError, ModelSpec
from stratad.model.weights import (
    AttentionWeights,
    DeltaNetWeights,
    LayerWeights,
    MlaWeights,
    MLPWeights,
    MoEWeights,
)

Want = Callable[[str, QTensor | None, tuple[int, ...]], None]

MAX_LAYERS = 4096
MAX_EXPERTS = 4096


def check_spec(spec: ModelSpec, source: str) -> None:
    """Counts a file states that no model has (before any is used as a size or divisor)."""
    counts = {
        "layers": spec.n_layers, "hidden size": spec.hidden, "attention heads": spec.n_heads,
        "KV heads": spec.n_kv_heads, "head dim": spec.head_dim, "vocabulary": spec.vocab_size,
        "context length": spec.context_length,
    }  # fmt: skip
    for what, n in counts.items():
        if n < 1:
            raise ModelError(f"{source}: {what} is {n}; it must be at least 1")
    if spec.n_layers > MAX_LAYERS or spec.n_experts > MAX_EXPERTS:
        raise ModelError(
            f"{source}: {spec.n_layers:,} layers of {spec.n_experts:,} experts (at most"
            f" {MAX_LAYERS:,} and {MAX_EXPERTS:,})"
        )
    if spec.is_moe and spec.expert_ffn < 1:
        raise ModelError(f"{source}: expert width is {spec.expert_ffn}; it must be at least 1")


def check_model(model: Model, layers: list[LayerWeights]) -> None:
    """Every weight of `model` (its `layers` built by the architecture) has the shape its spec
    implies; ModelError naming the first that does not."""
    spec, source = model.spec, str(model.source)

    def want(name: str, t: QTensor | None, shape: tuple[int, ...]) -> None:
        if t is not None and tuple(t.shape) != shape:
            raise ModelError(
                f"{source}: tensor {name} is {list(t.shape)}; the model's hyper-parameters make"
                f" it {list(shape)}"
            )

    h = spec.hidden
    want("embed_tokens", model.tensors.get("model.embed_tokens.weight"), (spec.vocab_size, h))
    want("lm_head", model.tensors.get("lm_head.weight"), (spec.vocab_size, h))
    want("norm", model.tensors.get("model.norm.weight"), (h,))
    for i, w in enumerate(layers):
        at = f"of layer {i}"
        want(f"attn_norm {at}", w.attn_norm, (h,))
        want(f"ffn_norm {at}", w.ffn_norm, (h,))
        a = w.attn
        if isinstance(a, MlaWeights):
            _mla(want, at, a, spec)
        elif isinstance(a, DeltaNetWeights):
            _deltanet(want, at, a, spec)
        else:
            _gqa(want, at, a, spec)
        if isinstance(w.mlp, MLPWeights):
            _mlp(want, f"mlp {at}", w.mlp, spec.ffn, h)
            continue
        moe: MoEWeights = w.mlp
        e, f = spec.n_experts, spec.expert_ffn
        want(f"router {at}", moe.router, (e, h))
        want(f"router bias {at}", moe.router_bias, (e,))
        want(f"experts' gate {at}", moe.experts.gate, (e, f, h))
        want(f"experts' up {at}", moe.experts.up, (e, f, h))
        want(f"experts' down {at}", moe.experts.down, (e, h, f))
        want(f"experts' gate bias {at}", moe.experts.gate_bias, (e, f))
        want(f"experts' up bias {at}", moe.experts.up_bias, (e, f))
        want(f"experts' down bias {at}", moe.experts.down_bias, (e, h))
        if moe.shared is not None:
            _mlp(want, f"shared expert {at}", moe.shared, spec.shared_expert_ffn, h)
        if moe.shared_gate is not None and tuple(moe.shared_gate.shape) not in ((1, h), (h,)):
            want(f"shared expert gate {at}", moe.shared_gate, (1, h))


def _mlp(want, what: str, m: MLPWeights, ffn: int, h: int) -> None:  # type: ignore[no-untyped-def]
    want(f"{what} gate", m.gate, (ffn, h))
    want(f"{what} up", m.up, (ffn, h))
    want(f"{what} down", m.down, (h, ffn))


def _gqa(want: Want, at: str, a: AttentionWeights, spec: ModelSpec) -> None:
    h, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
    want(f"q {at}", a.q, (2 * q if spec.attn_gate else q, h))  # gated: each head's q and gate
    want(f"k {at}", a.k, (kv, h))
    want(f"v {at}", a.v, (kv, h))
    want(f"o {at}", a.o, (h, q))
    want(f"q bias {at}", a.q_bias, (q,))
    want(f"k bias {at}", a.k_bias, (kv,))
    want(f"v bias {at}", a.v_bias, (kv,))
    want(f"o bias {at}", a.o_bias, (h,))
    want(f"attention sinks {at}", a.sinks, (spec.n_heads,))
    per_head = spec.qk_norm == "head"
    want(f"q norm {at}", a.q_norm, (spec.head_dim,) if per_head else (q,))
    want(f"k norm {at}", a.k_norm, (spec.head_dim,) if per_head else (kv,))


def _mla(want: Want, at: str, a: MlaWeights, spec: ModelSpec) -> None:
    """Multi-head latent attention's projections (`stratad.model.graph.mla`)."""
    assert spec.mla is not None
    h, heads, rank, rot = spec.hidden, spec.n_heads, spec.mla.kv_lora_rank, spec.mla.rope_dim
    q_in = spec.mla.q_lora_rank or h
    want(f"q {at}", a.q, (spec.q_dim, q_in))
    want(f"q_a {at}", a.q_a, (q_in, h))
    want(f"q_a norm {at}", a.q_a_norm, (q_in,))
    want(f"kv_a {at}", a.kv_a, (rank + rot, h))
    want(f"kv_a norm {at}", a.kv_a_norm, (rank,))
    want(f"kv_b {at}", a.kv_b, (heads * (spec.head_dim - rot + spec.value_dim), rank))
    want(f"o {at}", a.o, (h, heads * spec.value_dim))


def _deltanet(want: Want, at: str, a: DeltaNetWeights, spec: ModelSpec) -> None:
    """Gated DeltaNet's weights (`stratad.model.graph.deltanet`)."""
    net = spec.deltanet
    assert net is not None
    h, vh = spec.hidden, net.v_heads
    want(f"qkv {at}", a.qkv, (net.conv_dim, h))
    want(f"z {at}", a.z, (net.value_dim, h))
    want(f"ba {at}", a.ba, (2 * vh, h))
    want(f"conv {at}", a.conv, (net.conv_dim, net.conv_kernel))
    want(f"dt_bias {at}", a.dt_bias, (vh,))
    want(f"a {at}", a.a, (vh,))
    want(f"norm {at}", a.norm, (net.v_dim,))
    want(f"out {at}", a.out, (h, net.value_dim))
