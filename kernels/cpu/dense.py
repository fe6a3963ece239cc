"""A stack of dense transformer layers in one call of the CPU kernels (`kernels/cpu/dense.h`).

The algorithm is the torch forward's (`stratad/engine/reference/forward.py` with
`weights_mode.QuantWeights`, the reference this is tested against): RMSNorm, q/k/v products,
bias, RoPE, causal GQA attention (each token over its keys, as decode computes it), o product,
residual, RMSNorm, SwiGLU, residual. In C, every layer of a step runs in one OpenMP team with
no Python between the pieces; q/k/v (and gate/up) are one task list over a shared int8 copy
of their input; a prompt's tokens go through each weight row together.

Tensors in, checked once here (`DenseStack`: the weights; each call: x, the caches, RoPE's
tables); pointers to the C side. A call's rows may be several sequences' tokens (`CacheSpan`
each: the engine's batch), which share every weight read and attend each to its own cache.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.experts import CpuExperts, _check
from kernels.cpu.team import TeamSize
from kernels.formats.quant import QType

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
# keys and values are kept in halves, as llama.cpp keeps them: half the cache's memory and
# reads, and the attention llama.cpp computes (the engine is held to llama.cpp's logits)
CACHE_DTYPE = torch.float16
MAX_HEAD_DIM = 512  # dense.h's


class _Layer(ctypes.Structure):  # dense_layer_t
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("bias", _P * 3), ("w", _P * 7),
                ("qtype", _I32 * 7)]  # fmt: skip


class _Dims(ctypes.Structure):  # dense_dims_t
    _fields_ = [("hidden", _I64), ("n_heads", _I64), ("n_kv_heads", _I64), ("head_dim", _I64),
                ("ffn", _I64), ("rope_interleaved", _I32), ("eps", _F)]  # fmt: skip


@dataclass(frozen=True)
class DenseShape:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    rope_interleaved: bool
    eps: float

    def rows_cols(self) -> dict[str, tuple[int, int]]:
        """Each projection's [rows, cols]."""
        h, f = self.hidden, self.ffn
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (f, h),
                "up": (f, h), "down": (h, f)}  # fmt: skip


@dataclass(frozen=True)
class DenseLayer:
    """One layer's tensors: norms [H] float32, each projection's GGUF blocks and type (in
    `PROJECTIONS` order), q/k/v biases [rows] float32 or None."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    weights: tuple[tuple[torch.Tensor, QType], ...]
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class CacheSpan:
    """One sequence's rows of a layers call: the next `length` rows of x are its tokens at
    positions start .. start + length - 1; their keys and values go into k[l], v[l] (layer l's
    [>= start + length, Hkv, D] `CACHE_DTYPE`), where the earlier positions' already are."""

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    start: int
    length: int


@dataclass(frozen=True)
class StepArgs:
    """A layers call's per-token arrays (C's pos, seq, k_cache, v_cache), kept alive here."""

    tokens: int
    pos: np.ndarray  # [T] int64
    seq: np.ndarray  # [T] int32
    k: np.ndarray  # [spans * layers] uint64 addresses
    v: np.ndarray

    def pointers(self) -> tuple[int, int, int, int]:
        return self.pos.ctypes.data, self.seq.ctypes.data, self.k.ctypes.data, self.v.ctypes.data


class DenseStack:
    """x [T, H] float32 through every layer, in place, with one kernel call."""

    def __init__(
        self, kernels: CpuExperts, shape: DenseShape, layers: Sequence[DenseLayer]
    ) -> None:
        d, heads, kv = shape.head_dim, shape.n_heads, shape.n_kv_heads
        if d % 2 or d > MAX_HEAD_DIM or heads % kv:
            raise ValueError(f"head_dim {d} must be even and <= {MAX_HEAD_DIM}, and {heads} "
                             f"heads a multiple of {kv} kv heads")  # fmt: skip
        dims = shape.rows_cols()
        self.shape, self.layers = shape, list(layers)  # the tensors stay alive with the stack
        self._c_layers = (_Layer * len(layers))()
        for c, layer in zip(self._c_layers, layers, strict=True):
            for name, t in (("attn_norm", layer.attn_norm), ("ffn_norm", layer.ffn_norm)):
                _check(t, name, torch.float32, 1)
                if t.numel() != shape.hidden:
                    raise ValueError(f"{name} has {t.numel()} values, hidden is {shape.hidden}")
            c.attn_norm, c.ffn_norm = layer.attn_norm.data_ptr(), layer.ffn_norm.data_ptr()
            for i, (name, (w, qtype)) in enumerate(zip(PROJECTIONS, layer.weights, strict=True)):
                kernels._check_weight(w, qtype, *dims[name])
                c.w[i], c.qtype[i] = w.data_ptr(), int(qtype)
            for i, (name, b) in enumerate(zip(PROJECTIONS[:3], layer.biases, strict=True)):
                if b is not None:
                    _check(b, f"{name} bias", torch.float32, 1)
                    if b.numel() != dims[name][0]:
                        raise ValueError(f"{name} bias has {b.numel()} values, not {dims[name][0]}")
                c.bias[i] = None if b is None else b.data_ptr()
        self._dims = _Dims(shape.hidden, shape.n_heads, shape.n_kv_heads, shape.head_dim,
                           shape.ffn, int(shape.rope_interleaved), shape.eps)  # fmt: skip
        self._fn, self._tables = kernels._dense, kernels._tables
        self.team = TeamSize(kernels.threads)  # measured per call shape (kernels/cpu/team.py)

    def __call__(
        self, x: torch.Tensor, spans: Sequence[CacheSpan], cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """x [T, H] (in place): the spans' tokens in order (their lengths sum to T); cos, sin
        [T, D/2] float32 at each token's position (`layers.rope_tables`)."""
        s = self.shape
        a = check_step(x, spans, cos, sin, s.hidden, s.n_kv_heads, s.head_dim, len(self.layers))
        pos, seq, kp, vp = a.pointers()
        threads = self.team.pick(a.tokens)
        t0 = time.perf_counter()
        rc = self._fn(x.data_ptr(), a.tokens, pos, seq, ctypes.addressof(self._c_layers),
                      len(self.layers), ctypes.byref(self._dims), kp, vp, cos.data_ptr(),
                      sin.data_ptr(), threads, self._tables.data_ptr())  # fmt: skip
        self.team.record(a.tokens, threads, time.perf_counter() - t0)
        CpuExperts._raise(rc, "dense layers")


def check_step(
    x: torch.Tensor,
    spans: Sequence[CacheSpan],
    cos: torch.Tensor,
    sin: torch.Tensor,
    hidden: int,
    n_kv_heads: int,
    head_dim: int,
    n_layers: int,
) -> StepArgs:
    """A layers call's tensors checked (x [T, hidden] float32, each span's caches, RoPE's
    tables) and its per-token arrays."""
    _check(x, "x", torch.float32, 2)
    t = x.shape[0]
    if x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    for name, tab in (("cos", cos), ("sin", sin)):
        _check(tab, name, torch.float32, 2)
        if tuple(tab.shape) != (t, head_dim // 2):
            raise ValueError(f"{name} must be [{t}, {head_dim // 2}], got {tuple(tab.shape)}")
    if not spans or sum(sp.length for sp in spans) != t:
        raise ValueError(f"the spans hold {sum(sp.length for sp in spans)} tokens, x {t}")
    seen: set[int] = set()
    for sp in spans:
        if sp.start < 0 or sp.length < 1:
            raise ValueError(f"a span starts at {sp.start} with {sp.length} tokens")
        if len(sp.k) != n_layers or len(sp.v) != n_layers:
            raise ValueError(f"{len(sp.k)} and {len(sp.v)} cache layers for {n_layers} layers")
        for c in (*sp.k, *sp.v):
            _check(c, "cache", CACHE_DTYPE, 3)
            if c.shape[0] < sp.start + sp.length or tuple(c.shape[1:]) != (n_kv_heads, head_dim):
                raise ValueError(f"a cache layer {tuple(c.shape)} cannot hold "
                                 f"{sp.start + sp.length} positions of [{n_kv_heads}, "
                                 f"{head_dim}]")  # fmt: skip
            if c.data_ptr() in seen:
                raise ValueError("two spans or layers of one call share a cache")
            seen.add(c.data_ptr())
    pos = np.concatenate([np.arange(sp.start, sp.start + sp.length) for sp in spans])
    seq = np.repeat(np.arange(len(spans), dtype=np.int32), [sp.length for sp in spans])
    k = np.array([c.data_ptr() for sp in spans for c in sp.k], dtype=np.uint64)
    v = np.array([c.data_ptr() for sp in spans for c in sp.v], dtype=np.uint64)
    return StepArgs(t, pos.astype(np.int64), seq, k, v)
