"""The reference forward pass, torch only: dequantized weights, CPU or GPU.

This is the definition of what the model computes. Every fast path (Triton kernels,
offloaded experts) is tested against it. The same sequence of layers serves a model on a
CPU from its GGUF blocks: with `QuantWeights` (`stratad/engine/reference/weights_mode.py`) every
projection is a product by the compiled CPU kernels instead of a float matrix (the `cpu`
backend), and a model of dense layers runs them all in one kernel call per step
(`kernels/cpu/dense.py`, tested against these layers); the default `FloatWeights` is the
reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.cpu.dense import CACHE_DTYPE, CacheSpan
from kernels.formats.quant import QTensor
from stratad.engine.batch import Output, Seq, check_batch, reserve
from stratad.engine.expert_ffn import ExpertFfn, host_biases
from stratad.engine.kv import KVCache, KVPool
from stratad.engine.kv_format import PLAIN, KVFormat
from stratad.engine.recurrent import RecurrentState, state_for
from stratad.engine.reference.deltanet import deltanet
from stratad.engine.reference.layers import apply_rope, rms_norm, rope_tables, route_as
from stratad.engine.reference.store_moe import ExpertProvider
from stratad.engine.reference.weights_mode import (
    FloatEmbedding,
    FloatLinear,
    FloatWeights,
    Linear,
    Routed,
    WeightMode,
)
from stratad.engine.timing import StageTimer
from stratad.model.archs import ARCHS
from stratad.model.graph.activation import SILU, Activation
from stratad.model.spec import Model, ModelSpec
from stratad.model.weights import (
    AttentionWeights,
    DeltaNetWeights,
    LayerWeights,
    MlaWeights,
    MLPWeights,
    MoEWeights,
)

_Biases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Dense:
    gate: Linear
    up: Linear
    down: Linear
    act: Activation = SILU
    # the three projections' biases (gpt-oss's experts), each added after its product
    biases: _Biases | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate x, up x)): `layers.swiglu` with the products as linears."""
        if self.biases is None:
            return self.down(self.act(self.gate(x), self.up(x)))
        gb, ub, db = self.biases
        return self.down(self.act(self.gate(x) + gb, self.up(x) + ub)) + db


@dataclass(frozen=True)
class _Mla:
    """Multi-head latent attention's products (`stratad.model.graph.mla`)."""

    q: Linear  # or q_b, after q_a and its norm
    kv_a: Linear
    kv_a_norm: torch.Tensor
    kv_b: Linear
    q_a: Linear | None
    q_a_norm: torch.Tensor | None


@dataclass(frozen=True)
class _DeltaNet:
    """A Gated DeltaNet layer's products and weights (`stratad.model.graph.deltanet`)."""

    qkv: Linear
    z: Linear
    ba: Linear
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # conv, dt_bias, a, norm


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    q: Linear | None  # None, with k and v: multi-head latent attention (`mla`)
    k: Linear | None
    v: Linear | None
    o: Linear
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_bias: torch.Tensor | None
    sinks: torch.Tensor | None  # [Hq] (spec.attn_sinks)
    window: int  # the layer's sliding window (spec.window); 0: none
    ffn_norm: torch.Tensor
    dense: _Dense | None
    router: Linear | None
    router_bias: torch.Tensor | None  # [E] as the spec's routing adds it
    experts: Callable[[int], _Dense] | None  # expert e of the model's stacks
    expert_biases: Callable[[int], _Biases] | None  # expert e's (gpt-oss)
    routed: Routed | None  # all of them in one call (the cpu engine)
    shared: _Dense | None
    shared_gate: Linear | None
    mla: _Mla | None = None
    deltanet: _DeltaNet | None = None  # a linear-attention layer (o: its out projection)


def _expert_biases(
    moe: MoEWeights, mode: WeightMode
) -> Callable[[int], _Biases] | None:
    """Expert e's (gate, up, down) biases, rows of the stacks' (None: they have none)."""
    ex = moe.experts
    if ex.gate_bias is None or ex.up_bias is None or ex.down_bias is None:
        return None
    gb, ub, db = (mode.vector(t) for t in (ex.gate_bias, ex.up_bias, ex.down_bias))
    return lambda e: (gb[e], ub[e], db[e])


def _stacked(
    moe: MoEWeights, mode: WeightMode, act: Activation,
    biases: Callable[[int], _Biases] | None,
) -> Callable[[int], _Dense]:  # fmt: skip
    """Expert e of the stacks: float stacks dequantized once, or slices of the blocks."""
    ex = moe.experts
    if isinstance(mode, FloatWeights):
        gate, up, down = (mode.float(t) for t in (ex.gate, ex.up, ex.down))
        return lambda e: _Dense(FloatLinear(gate[e]), FloatLinear(up[e]), FloatLinear(down[e]),
                                act, biases(e) if biases else None)
    return lambda e: _Dense(mode.linear(ex.gate[e]), mode.linear(ex.up[e]),
                            mode.linear(ex.down[e]), act,
                            biases(e) if biases else None)


def _layer(w: LayerWeights, mode: WeightMode, spec: ModelSpec, i: int, stacked: bool) -> _Layer:
    def opt(t: QTensor | None) -> torch.Tensor | None:
        return None if t is None else mode.vector(t)

    act = spec.activation

    def mlp(m: MLPWeights) -> _Dense:
        return _Dense(mode.linear(m.gate), mode.linear(m.up), mode.linear(m.down), act)

    a = w.attn
    moe = w.mlp if isinstance(w.mlp, MoEWeights) else None
    biases = _expert_biases(moe, mode) if moe else None
    gqa = a if isinstance(a, AttentionWeights) else None
    mla = net = None
    if isinstance(a, MlaWeights):
        mla = _Mla(mode.linear(a.q), mode.linear(a.kv_a), mode.vector(a.kv_a_norm),
                   mode.linear(a.kv_b), mode.linear(a.q_a) if a.q_a else None,
                   opt(a.q_a_norm))  # fmt: skip
    if isinstance(a, DeltaNetWeights):
        net = _DeltaNet(mode.linear(a.qkv), mode.linear(a.z), mode.linear(a.ba),
                        (mode.vector(a.conv), mode.vector(a.dt_bias), mode.vector(a.a),
                         mode.vector(a.norm)))  # fmt: skip
    return _Layer(
        attn_norm=mode.vector(w.attn_norm),
        q=mode.linear(gqa.q) if gqa else None,
        k=mode.linear(gqa.k) if gqa else None,
        v=mode.linear(gqa.v) if gqa else None,
        o=mode.linear(a.out if isinstance(a, DeltaNetWeights) else a.o),
        q_bias=opt(gqa.q_bias) if gqa else None,
        k_bias=opt(gqa.k_bias) if gqa else None,
        v_bias=opt(gqa.v_bias) if gqa else None,
        q_norm=opt(gqa.q_norm) if gqa else None,
        k_norm=opt(gqa.k_norm) if gqa else None,
        o_bias=opt(gqa.o_bias) if gqa else None,
        sinks=opt(gqa.sinks) if gqa else None,
        mla=mla,
        deltanet=net,
        window=spec.window(i),
        ffn_norm=mode.vector(w.ffn_norm),
        dense=mlp(w.mlp) if isinstance(w.mlp, MLPWeights) else None,
        router=mode.linear(moe.router) if moe else None,
        router_bias=opt(moe.router_bias) if moe else None,
        experts=_stacked(moe, mode, act, biases) if moe and stacked else None,
        expert_biases=biases,
        routed=mode.routed(moe) if moe and stacked else None,
        shared=mlp(moe.shared) if moe and moe.shared else None,
        shared_gate=mode.linear(moe.shared_gate) if moe and moe.shared_gate else None,
    )


def _latent_qkv(
    spec: ModelSpec, m: _Mla, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-head latent attention's q, k [T, H, D] and v [T, H, value dims] for x [T, H]:
    each head's unrotated part then the rotated one (the key's shared by every head), the
    latent expanded (`stratad.model.graph.mla`); q carries the spec's score scale."""
    assert spec.mla is not None
    t, heads, rot, eps = x.shape[0], spec.n_heads, spec.mla.rope_dim, spec.rms_eps
    nope = spec.head_dim - rot
    q_in = x if m.q_a is None or m.q_a_norm is None else rms_norm(m.q_a(x), m.q_a_norm, eps)
    q = m.q(q_in).view(t, heads, spec.head_dim)
    latent, k_rot = m.kv_a(x).split([spec.mla.kv_lora_rank, rot], dim=-1)
    kv = m.kv_b(rms_norm(latent, m.kv_a_norm, eps)).view(t, heads, nope + spec.value_dim)
    k_nope, v = kv.split([nope, spec.value_dim], dim=-1)
    q_rot = apply_rope(q[..., nope:], cos, sin, spec.rope_interleaved)
    k_rot = apply_rope(k_rot.reshape(t, 1, rot), cos, sin, spec.rope_interleaved)
    q = torch.cat((q[..., :nope], q_rot), dim=-1)
    if spec.attn_scale != 1.0:
        q = q * spec.attn_scale
    return q, torch.cat((k_nope, k_rot.expand(t, heads, rot)), dim=-1), v


class ReferenceForward:
    """Computes logits for new tokens of a sequence (`__call__`) or of a batch (`step`: what
    each sequence's `Output` asks), appending to their KV caches."""

    def __init__(
        self,
        model: Model,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        experts: ExpertProvider | None = None,
        timer: StageTimer | None = None,
        weights: WeightMode | None = None,
        kv_format: KVFormat = PLAIN,
    ) -> None:
        """`weights`: how the weights are held (default: dequantized to `dtype` on `device`,
        the reference); `experts`: None, the model's stacks (dequantized once as floats);
        else fetched from the provider per use. `kv_format`: the quantized cache whose values
        attention reads (each key and value written as its stored form gives it back)."""
        self.spec: ModelSpec = model.spec
        self.timer = timer or StageTimer(enabled=False)
        self.device = torch.device(device)
        self.mode = weights or FloatWeights(self.device, dtype)
        self.dtype = self.mode.dtype
        self.experts = experts
        arch = ARCHS[model.spec.arch]
        weights_list = [arch.layer(model, i) for i in range(model.spec.n_layers)]
        # the cpu engine: a step's experts from the store in one kernel call, their biases and
        # activation (gpt-oss's) handed to the kernels by the store's row
        self.store_experts = self.mode.store_routed(experts) if experts is not None else None
        first = model.spec.dense_layers
        moes = {i - first: w.mlp for i, w in enumerate(weights_list)
                if isinstance(w.mlp, MoEWeights)}  # fmt: skip
        biases = {row: b for row, moe in moes.items() if (b := host_biases(moe)) is not None}
        self.ffn = ExpertFfn(biases, model.spec.activation)
        self.layers = [_layer(w, self.mode, model.spec, i, experts is None)
                       for i, w in enumerate(weights_list)]  # fmt: skip
        # the cpu engine's layers in one kernel call per step, where it can
        self.stack = self.mode.layer_stack(self.spec, weights_list, experts)
        self.kv_format = kv_format
        embed = model.tensor("model.embed_tokens.weight")
        self.embed = self.mode.embedding(embed)
        self.norm = self.mode.vector(model.tensor("model.norm.weight"))
        if isinstance(self.embed, FloatEmbedding) and model.spec.tie_embeddings:
            self.lm_head: Linear = FloatLinear(self.embed.table)  # one float copy, not two
        else:
            head = embed if model.spec.tie_embeddings else model.tensor("lm_head.weight")
            self.lm_head = self.mode.linear(head)
        # Routing counts per (layer, expert): the expert profile the store plans from.
        # Rows: the MoE layers (the store's grid, past any leading dense layers).
        self.first_moe = self.spec.dense_layers
        self.route_counts = torch.zeros(
            (self.spec.n_layers - self.first_moe, max(self.spec.n_experts, 1)), dtype=torch.int64
        )

    @property
    def path(self) -> str:
        """How a step reaches the weights, for the start-up log."""
        experts = ", the routed experts from the store's tiers" if self.experts is not None else ""
        if self.stack is not None:
            return f"every layer in one kernel call per step{experts}"
        if self.store_experts is not None or any(w.routed for w in self.layers):
            return f"layer by layer, a layer's routed experts in one kernel call{experts}"
        return f"layer by layer{experts}"

    def new_pool(self, tokens: int) -> KVPool:
        """A KV pool of at least `tokens` rows. Its attention reads a cache up to its length,
        never further (torch gathers, and the cpu engine's C loops): host pages commit as
        blocks are first written."""
        dtype = self.dtype if self.stack is None else CACHE_DTYPE  # halves, as llama.cpp's
        # the cpu engine stores int8 or 4-bit itself; the torch layers round-trip into floats
        fmt = self.kv_format if self.stack is not None else PLAIN
        return KVPool.allocate(self.spec, tokens, [self.device] * self.spec.n_layers, dtype,
                               fmt=fmt)  # fmt: skip

    def new_cache(self, max_len: int) -> KVCache:
        """A cache of `max_len` tokens (the context) on a pool of its own."""
        return KVCache(self.new_pool(max_len), max_len)

    def step(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        """A batch: each sequence's `Output` (logits as `__call__` gives them, or the final
        norm's output [T, H] float32 of its new tokens). The reference defines
        each sequence alone and runs them one after another; the one-call layers of the cpu
        engine take the whole batch in one call (every weight read once for all its tokens),
        each sequence's results bit for bit those of it alone."""
        check_batch(seqs)
        reserve(seqs)
        if self.stack is not None:
            return self._stacked(seqs)
        return [self._alone(s.tokens, s.cache, s.out) for s in seqs]

    def __call__(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits [T, V] for every new token (or [1, V] for the last one)."""
        if cache.length + len(tokens) > cache.capacity:
            raise ValueError(
                f"{cache.length + len(tokens)} tokens exceed the KV cache of {cache.capacity}"
            )
        seq = Seq.logits(cache, tokens, all_logits)
        reserve([seq])
        if self.stack is not None:
            return self._stacked([seq])[0]
        return self._alone(tokens, cache, seq.out)

    @torch.inference_mode()
    def _stacked(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        """`step` through the one-call layers: every sequence's new tokens in one call."""
        assert self.stack is not None
        spec, stage = self.spec, self.timer.stage
        spans = [CacheSpan(s.cache.k, s.cache.v, s.cache.length, len(s.tokens),
                           s.cache.host_table(), s.cache.block_size,
                           *_scales(s.cache.pool)) for s in seqs]  # fmt: skip
        positions = torch.cat([torch.arange(sp.start, sp.start + sp.length) for sp in spans])
        x = self.embed(torch.tensor([t for s in seqs for t in s.tokens], device=self.device))
        x = x.to(self.dtype).contiguous()  # [T, H]
        cos, sin = rope_tables(spec, positions, self.device)
        with stage("layers"):
            routed = self.stack(x, spans, cos, sin)
        if routed is not None:  # [layers, T, k]: the MoE stack's experts per token
            flat = routed.reshape(spec.n_layers, -1)
            self.route_counts.scatter_add_(1, flat, torch.ones_like(flat))
        rows: list[int] = []  # the rows each sequence asks for, in order
        sizes: list[int] = []
        at = 0
        for s in seqs:
            n = len(s.tokens)
            mine = range(at + n - 1, at + n) if s.out is Output.NEXT else range(at, at + n)
            rows.extend(mine)
            sizes.append(len(mine))
            at += n
            s.cache.length += n
            s.cache.tokens.extend(s.tokens)
        with stage("head"):
            normed = rms_norm(x[rows], self.norm, spec.rms_eps).split(sizes)
            heads = [i for i, s in enumerate(seqs) if s.out is not Output.HIDDEN]
            logits = (
                self.lm_head(torch.cat([normed[i] for i in heads])).float().split(
                    [sizes[i] for i in heads])
                if heads else ()
            )  # fmt: skip
        out = [n.float() for n in normed]
        for i, lg in zip(heads, logits, strict=True):
            out[i] = lg
        return out

    @torch.inference_mode()
    def _alone(self, tokens: list[int], cache: KVCache, out: Output) -> torch.Tensor:
        """One sequence, layer by layer."""
        spec, start, t = self.spec, cache.length, len(tokens)
        ids = torch.tensor(tokens, device=self.device)
        x = self.embed(ids).to(self.dtype)  # [T, H]
        cos, sin = rope_tables(spec, torch.arange(start, start + t), self.device)
        stage = self.timer.stage
        held = state_for(cache.recurrent, start) if spec.deltanet else None
        for i, layer in enumerate(self.layers):
            with stage("attention"):
                h = rms_norm(x, layer.attn_norm, spec.rms_eps)
                if layer.deltanet is not None and held is not None:
                    x = x + self._linear_attention(i, layer, layer.deltanet, h, held)
                else:
                    x = x + self._attention(i, layer, h, cache, cos, sin)
            h = rms_norm(x, layer.ffn_norm, spec.rms_eps)
            if layer.dense is not None:
                with stage("mlp"):
                    x = x + layer.dense(h)
            else:
                x = x + self._moe(i, layer, h)
        cache.length = start + t
        cache.tokens.extend(tokens)
        if held is not None:
            held.length, cache.recurrent = cache.length, held
        if out is Output.NEXT:
            x = x[-1:]
        with stage("head"):
            normed = rms_norm(x, self.norm, spec.rms_eps)
            return normed.float() if out is Output.HIDDEN else self.lm_head(normed).float()

    def _attention(
        self,
        i: int,
        w: _Layer,
        x: torch.Tensor,
        cache: KVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        spec, t = self.spec, x.shape[0]
        if w.mla is not None:
            q, k, v = _latent_qkv(spec, w.mla, x, cos, sin)
            return self._attend(i, w, q, k, v, cache)
        assert w.q is not None and w.k is not None and w.v is not None
        q, k, v = w.q(x), w.k(x), w.v(x)  # [T, Hq*D] [T, Hkv*D] [T, Hkv*D]
        gate = None
        if spec.attn_gate:  # per head: its query, then its output's gate (Qwen3-Next)
            both = q.view(t, spec.n_heads, 2, spec.head_dim)
            q, gate = both[:, :, 0].reshape(t, -1), both[:, :, 1].reshape(t, -1)
        if w.q_bias is not None and w.k_bias is not None and w.v_bias is not None:
            q, k, v = q + w.q_bias, k + w.k_bias, v + w.v_bias
        if spec.qk_norm == "full" and w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, spec.rms_eps), rms_norm(k, w.k_norm, spec.rms_eps)
        q = q.view(t, spec.n_heads, spec.head_dim)
        k = k.view(t, spec.n_kv_heads, spec.head_dim)
        v = v.view(t, spec.n_kv_heads, spec.head_dim)
        if spec.qk_norm == "head" and w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, spec.rms_eps), rms_norm(k, w.k_norm, spec.rms_eps)
        q = apply_rope(q, cos, sin, spec.rope_interleaved)
        k = apply_rope(k, cos, sin, spec.rope_interleaved)
        return self._attend(i, w, q, k, v, cache, gate)

    def _linear_attention(
        self, i: int, w: _Layer, net: _DeltaNet, x: torch.Tensor, held: RecurrentState
    ) -> torch.Tensor:
        """Layer i's Gated DeltaNet output for x [T, H], continuing the sequence's state."""
        assert self.spec.deltanet is not None
        mixed = deltanet(self.spec.deltanet, i, net.qkv(x), net.z(x), net.ba(x), net.weights,
                         self.spec.rms_eps, held)  # fmt: skip
        return w.o(mixed)

    def _attend(
        self, i: int, w: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, gate: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Layer i's output projection of q [T, Hq, D]'s attention over the cache, k and v
        [T, Hkv, D or the value dims] written at its end first (times sigmoid(gate) [T, Hq D]
        where the heads are gated)."""
        t, start = q.shape[0], cache.length
        k, v = self.kv_format.round_trip(k), self.kv_format.round_trip(v)
        rows = cache.rows(0, start + t, self.device)
        cache.k[i].index_copy_(0, rows[start:], k.to(cache.k[i].dtype))
        cache.v[i].index_copy_(0, rows[start:], v.to(cache.v[i].dtype))
        out = self.mode.attention(q, cache.k[i][rows], cache.v[i][rows], start, w.sinks, w.window)
        out = out.reshape(t, -1)
        out = w.o(out if gate is None else out * torch.sigmoid(gate))
        return out if w.o_bias is None else out + w.o_bias

    def _moe(self, i: int, w: _Layer, x: torch.Tensor) -> torch.Tensor:
        assert w.router is not None
        spec, stage = self.spec, self.timer.stage
        with stage("router"):
            weights, ids = route_as(spec, w.router(x), w.router_bias)
            row = i - self.first_moe  # the store's layer
            self.route_counts[row] += torch.bincount(ids.flatten().cpu(), minlength=spec.n_experts)
        out = torch.zeros_like(x, dtype=torch.float32)
        one_call = w.routed is not None or (
            self.store_experts is not None and self.store_experts.reads(row)
        )
        if one_call:
            with stage("experts"):  # the store's fetches included
                extras = self.ffn.extras(row, ids)
                if w.routed is not None:
                    w.routed(x.float().contiguous(), ids, weights, out, extras)
                else:
                    assert self.store_experts is not None
                    self.store_experts(row, x.float().contiguous(), ids, weights, out, extras)
        for e in () if one_call else ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            with stage("expert fetch"):  # from the store's tiers
                expert = self._expert(i, w, e)
            with stage("experts"):
                y = expert(x[rows]).float()
                out.index_add_(0, rows, y * weights[rows, slot, None])
        if w.shared is not None:
            with stage("shared expert"):
                s = w.shared(x).float()
                gate = w.shared_gate
                out += s if gate is None else torch.sigmoid(gate(x).float()) * s
        return out.to(x.dtype)

    def _expert(self, i: int, w: _Layer, e: int) -> _Dense:
        if self.experts is None:
            assert w.experts is not None
            return w.experts(e)
        m = self.experts.get(i - self.first_moe, e)  # float weights: dequantized per use
        biases = w.expert_biases(e) if w.expert_biases else None
        return _Dense(self.mode.linear(m.gate), self.mode.linear(m.up), self.mode.linear(m.down),
                      self.spec.activation, biases)


def _scales(pool: KVPool) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """An int8 pool's k and v scales per layer; (None, None): a pool of halves."""
    return (pool.k_scale, pool.v_scale) if pool.quantized else (None, None)
