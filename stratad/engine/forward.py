"""The reference forward pass, torch only: dequantized weights, CPU or GPU.

This is the definition of what the model computes. Every fast path (Triton kernels,
offloaded experts) is tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.quant import QTensor
from stratad.engine.batch import Seq, check_batch
from stratad.engine.kv import KVCache
from stratad.engine.layers import apply_rope, attention, rms_norm, rope_tables, route, swiglu
from stratad.engine.timing import StageTimer
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelSpec
from stratad.model.weights import LayerWeights, MLPWeights, MoEWeights


class ExpertProvider(Protocol):
    """Where routed experts come from instead of the model's stacks (the expert store)."""

    def get(self, layer: int, expert: int) -> MLPWeights: ...


def _f(t: QTensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.dequantize().to(device=device, dtype=dtype)


@dataclass(frozen=True)
class _Dense:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    dense: _Dense | None
    router: torch.Tensor | None
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # [E,F,H] [E,F,H] [E,H,F]
    shared: _Dense | None
    shared_gate: torch.Tensor | None


def _layer(
    w: LayerWeights, device: torch.device, dtype: torch.dtype, stacked: bool = True
) -> _Layer:
    def f(t: QTensor) -> torch.Tensor:
        return t.dequantize().to(device=device, dtype=dtype)

    def mlp(m: MLPWeights) -> _Dense:
        return _Dense(f(m.gate), f(m.up), f(m.down))

    a = w.attn
    moe = w.mlp if isinstance(w.mlp, MoEWeights) else None
    return _Layer(
        attn_norm=f(w.attn_norm),
        q=f(a.q),
        k=f(a.k),
        v=f(a.v),
        o=f(a.o),
        q_bias=_f(a.q_bias, device, dtype),
        k_bias=_f(a.k_bias, device, dtype),
        v_bias=_f(a.v_bias, device, dtype),
        q_norm=_f(a.q_norm, device, dtype),
        k_norm=_f(a.k_norm, device, dtype),
        ffn_norm=f(w.ffn_norm),
        dense=mlp(w.mlp) if isinstance(w.mlp, MLPWeights) else None,
        router=f(moe.router) if moe else None,
        experts=(
            (f(moe.experts.gate), f(moe.experts.up), f(moe.experts.down))
            if moe and stacked
            else None
        ),
        shared=mlp(moe.shared) if moe and moe.shared else None,
        shared_gate=_f(moe.shared_gate, device, dtype) if moe else None,
    )


class ReferenceForward:
    """Computes logits for new tokens of one sequence, appending to its KV cache."""

    def __init__(
        self,
        model: Model,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        experts: ExpertProvider | None = None,
        timer: StageTimer | None = None,
    ) -> None:
        self.spec: ModelSpec = model.spec
        self.timer = timer or StageTimer(enabled=False)
        self.device = torch.device(device)
        self.dtype = dtype
        # None: routed experts are dequantized once here; else fetched and dequantized per use.
        self.experts = experts
        arch = ARCHS[model.spec.arch]
        self.layers = [
            _layer(arch.layer(model, i), self.device, dtype, stacked=experts is None)
            for i in range(model.spec.n_layers)
        ]
        self.embed = model.tensor("model.embed_tokens.weight").dequantize(dtype).to(self.device)
        self.norm = model.tensor("model.norm.weight").dequantize(dtype).to(self.device)
        self.lm_head = (
            self.embed
            if model.spec.tie_embeddings
            else model.tensor("lm_head.weight").dequantize(dtype).to(self.device)
        )
        # Routing counts per (layer, expert): the expert profile the store plans from.
        self.route_counts = torch.zeros(
            (self.spec.n_layers, max(self.spec.n_experts, 1)), dtype=torch.int64
        )

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.allocate(self.spec, max_len, self.device, self.dtype)

    def step(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        """A batch, one sequence after another: the reference defines each sequence alone."""
        check_batch(seqs)
        return [self(s.tokens, s.cache, s.all_logits) for s in seqs]

    @torch.inference_mode()
    def __call__(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits [T, V] for every new token (or [1, V] for the last one)."""
        spec, start, t = self.spec, cache.length, len(tokens)
        if start + t > cache.capacity:
            raise ValueError(f"{start + t} tokens exceed the KV cache of {cache.capacity}")
        ids = torch.tensor(tokens, device=self.device)
        x = self.embed[ids]  # [T, H]
        cos, sin = rope_tables(spec, torch.arange(start, start + t), self.device)
        stage = self.timer.stage
        for i, layer in enumerate(self.layers):
            with stage("attention"):
                x = x + self._attention(
                    i, layer, rms_norm(x, layer.attn_norm, spec.rms_eps), cache, cos, sin
                )
            h = rms_norm(x, layer.ffn_norm, spec.rms_eps)
            if layer.dense is not None:
                with stage("mlp"):
                    x = x + swiglu(h, layer.dense.gate, layer.dense.up, layer.dense.down)
            else:
                x = x + self._moe(i, layer, h)
        cache.length = start + t
        cache.tokens.extend(tokens)
        if not all_logits:
            x = x[-1:]
        with stage("head"):
            return (rms_norm(x, self.norm, spec.rms_eps) @ self.lm_head.T).float()

    def _attention(
        self,
        i: int,
        w: _Layer,
        x: torch.Tensor,
        cache: KVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        spec, t, start = self.spec, x.shape[0], cache.length
        q, k, v = x @ w.q.T, x @ w.k.T, x @ w.v.T  # [T, Hq*D] [T, Hkv*D] [T, Hkv*D]
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
        cache.k[i][start : start + t] = k
        cache.v[i][start : start + t] = v
        out = attention(q, cache.k[i][: start + t], cache.v[i][: start + t], start)
        return out.reshape(t, spec.q_dim) @ w.o.T

    def _moe(self, i: int, w: _Layer, x: torch.Tensor) -> torch.Tensor:
        assert w.router is not None
        spec, stage = self.spec, self.timer.stage
        with stage("router"):
            weights, ids = route(x @ w.router.T, spec.n_experts_used, spec.norm_topk_prob)
            self.route_counts[i] += torch.bincount(ids.flatten().cpu(), minlength=spec.n_experts)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            with stage("expert fetch"):  # from the store's tiers, dequantized
                gate, up, down = self._expert(i, w, e)
            with stage("experts"):
                y = swiglu(x[rows], gate, up, down).float()
                out.index_add_(0, rows, y * weights[rows, slot, None])
        if w.shared is not None and w.shared_gate is not None:
            with stage("shared expert"):
                s = swiglu(x, w.shared.gate, w.shared.up, w.shared.down).float()
                out += torch.sigmoid((x @ w.shared_gate.T).float()) * s
        return out.to(x.dtype)

    def _expert(self, i: int, w: _Layer, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.experts is None:
            assert w.experts is not None
            gate, up, down = w.experts
            return gate[e], up[e], down[e]
        m = self.experts.get(i, e)
        f = [t.dequantize().to(self.device, self.dtype) for t in (m.gate, m.up, m.down)]
        return f[0], f[1], f[2]
