"""A stack of dense transformer layers in one call of the CPU kernels (`kernels/cpu/dense.h`).

The algorithm is the torch forward's (`stratad/engine/reference/forward.py` with
`weights_mode.QuantWeights`, the reference this is tested against): RMSNorm, q/k/v products,
bias, RoPE, causal GQA attention (each token over its keys, as decode computes it), o product,
residual, RMSNorm, SwiGLU, residual. In C, every layer of a step runs in one OpenMP team with
no Python between the pieces; q/k/v (and gate/up) are one task list over a shared int8 copy
of their input; a prompt's tokens go through each weight row together.

Tensors in, checked once here (`DenseStack`: the weights; each call: x, the caches, RoPE's
tables); pointers to the C side. A call's rows may be several sequences' tokens (`CacheSpan`
each: the engine's batch), which share every weight read and attend each to its own cache: a
contiguous one of its own, or its blocks of a pool of KV blocks that the call's paged spans
share (paged KV, as vLLM's), read and written through its block table.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.experts import CpuExperts, _check
from kernels.cpu.file_pages import FileMappings
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
                ("ffn", _I64), ("rope_interleaved", _I32), ("eps", _F),
                ("kv_format", _I32)]  # fmt: skip


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
    positions start .. start + length - 1; their keys and values go into rows of k[l], v[l]
    (layer l's [rows, Hkv, D] `CACHE_DTYPE`, contiguous), where the earlier positions' already
    are.

    Contiguous (no table): k[l], v[l] are the sequence's own, position p at row p (rows >=
    start + length). Paged: k[l], v[l] are a pool's layer-l tensors of n_blocks * block_size
    rows, shared by every paged span of the call, and `table` holds the sequence's block ids
    (1-D integers, int32 as the engine keeps them; numpy or a CPU tensor; at least
    ceil((start + length) / block_size) of them, those past it unread): position p at row
    table[p // block_size] * block_size + p % block_size. block_size is a power of two >= 8, so
    a block holds whole groups of the eight keys attention scores at once: a paged cache gives
    the bits of a contiguous one.

    Quantized (`k_scale`, `v_scale` given, for every span of the call or none): k[l], v[l] are
    int8, and k_scale[l], v_scale[l] [rows, Hkv] float32 their scales
    (`kernels.formats.kv_int8`'s layout: a value is q times its row and head's scale); or k[l],
    v[l] are 4-bit codes uint8 [rows, Hkv, D / 2] and k_scale[l], v_scale[l] float16 (scale,
    minimum) pairs [rows, Hkv, D / 32, 2] (`kernels.formats.kv_q4`)."""

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    start: int
    length: int
    table: np.ndarray | torch.Tensor | None = None  # [>= blocks the positions need]
    block_size: int = 0  # positions a block holds; paged spans only
    k_scale: Sequence[torch.Tensor] | None = None
    v_scale: Sequence[torch.Tensor] | None = None


@dataclass(frozen=True)
class StepArgs:
    """A layers call's arrays (C's pos, seq, k_cache, v_cache, tables, block), kept alive
    here."""

    tokens: int
    pos: np.ndarray  # [T] int64
    seq: np.ndarray  # [T] int32
    k: np.ndarray  # [spans * layers] uint64 addresses
    v: np.ndarray
    k_scale: np.ndarray | None  # the same for int8 caches' scales; None: halves
    v_scale: np.ndarray | None
    kv_format: int  # C's KV_HALF 0, KV_INT8 1, KV_Q4 2 (attn_layer.h)
    tables: np.ndarray  # [spans] uint64: the address of each span's block ids in `ids`
    block: np.ndarray  # [spans] int64: its block size
    ids: np.ndarray  # every span's block ids, int32 (a contiguous span's: one block, 0)

    def pointers(self) -> tuple[int, int, int, int, int | None, int | None, int, int]:
        """pos, seq, k, v, k_scale, v_scale (None: halves), tables, block."""
        ks, vs = (None, None) if self.k_scale is None or self.v_scale is None else (
            self.k_scale.ctypes.data, self.v_scale.ctypes.data)  # fmt: skip
        return (self.pos.ctypes.data, self.seq.ctypes.data, self.k.ctypes.data,
                self.v.ctypes.data, ks, vs, self.tables.ctypes.data,
                self.block.ctypes.data)  # fmt: skip


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
        self._read: list[torch.Tensor] = []  # the weights as the kernels read them
        files = FileMappings.now()
        self._c_layers = (_Layer * len(layers))()
        for c, layer in zip(self._c_layers, layers, strict=True):
            for name, t in (("attn_norm", layer.attn_norm), ("ffn_norm", layer.ffn_norm)):
                _check(t, name, torch.float32, 1)
                if t.numel() != shape.hidden:
                    raise ValueError(f"{name} has {t.numel()} values, hidden is {shape.hidden}")
            c.attn_norm, c.ffn_norm = layer.attn_norm.data_ptr(), layer.ffn_norm.data_ptr()
            for i, (name, (w, qtype)) in enumerate(zip(PROJECTIONS, layer.weights, strict=True)):
                read, code = kernels.interleave(w, qtype, *dims[name], files)
                self._read.append(read)
                c.w[i], c.qtype[i] = read.data_ptr(), code
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
        pos, seq, kp, vp, ksp, vsp, tp, bp = a.pointers()
        self._dims.kv_format = a.kv_format
        threads = self.team.pick(a.tokens)
        t0 = time.perf_counter()
        rc = self._fn(x.data_ptr(), a.tokens, pos, seq, ctypes.addressof(self._c_layers),
                      len(self.layers), ctypes.byref(self._dims), kp, vp, ksp, vsp, tp, bp,
                      cos.data_ptr(), sin.data_ptr(), threads, self._tables.data_ptr())  # fmt: skip
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
    """A layers call's tensors checked (x [T, hidden] float32, each span's caches and block
    table, RoPE's tables) and its arrays for C."""
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
    # a cache's address: its owner (the span, or -1: a pool, which paged spans share) and its
    # place in the span's k + v; any other second use is an error
    owner: dict[int, tuple[int, int]] = {}
    tables: list[tuple[np.ndarray, int]] = []
    quantized = spans[0].k_scale is not None
    q4 = quantized and spans[0].k[0].dtype == torch.uint8  # else int8 (checked below)
    code_tail = (n_kv_heads, head_dim // 2) if q4 else (n_kv_heads, head_dim)
    code_dtype = torch.uint8 if q4 else torch.int8 if quantized else CACHE_DTYPE
    scale_tail = (n_kv_heads, head_dim // 32, 2) if q4 else (n_kv_heads,)
    scale_dtype = torch.float16 if q4 else torch.float32
    for i, sp in enumerate(spans):
        if sp.start < 0 or sp.length < 1:
            raise ValueError(f"a span starts at {sp.start} with {sp.length} tokens")
        if len(sp.k) != n_layers or len(sp.v) != n_layers:
            raise ValueError(f"{len(sp.k)} and {len(sp.v)} cache layers for {n_layers} layers")
        scales = (*sp.k_scale, *sp.v_scale) if sp.k_scale and sp.v_scale else ()
        if (sp.k_scale is not None or sp.v_scale is not None) != quantized or (
                quantized and len(scales) != 2 * n_layers):
            raise ValueError("every span of a call has k and v scales for each layer, or none")
        for j, c in enumerate((*sp.k, *sp.v, *scales)):
            me, seen = (i if sp.table is None else -1, j), owner.get(c.data_ptr())
            if seen == me:  # a pool's, checked for an earlier span
                continue
            if seen is not None:
                raise ValueError("two spans or layers of one call share a cache")
            owner[c.data_ptr()] = me
            if j >= 2 * n_layers:  # the scales of cache j - 2 n_layers
                _check_cache(c, scale_tail, scale_dtype)
                if c.shape[0] != (*sp.k, *sp.v)[j - 2 * n_layers].shape[0]:
                    raise ValueError(f"scales of {c.shape[0]} rows for a cache layer of "
                                     f"{(*sp.k, *sp.v)[j - 2 * n_layers].shape[0]}")  # fmt: skip
            else:
                _check_cache(c, code_tail, code_dtype)
        tables.append(_block_table(sp, min((c.shape[0] for c in (*sp.k, *sp.v)), default=0)))
    _check_writes(spans, tables)
    pos = np.concatenate([np.arange(sp.start, sp.start + sp.length) for sp in spans])
    seq = np.repeat(np.arange(len(spans), dtype=np.int32), [sp.length for sp in spans])

    def addresses(per_span: Callable[[CacheSpan], Sequence[torch.Tensor] | None]) -> np.ndarray:
        return np.array([c.data_ptr() for sp in spans for c in per_span(sp) or ()],
                        dtype=np.uint64)  # fmt: skip

    k, v = addresses(lambda sp: sp.k), addresses(lambda sp: sp.v)
    ks = addresses(lambda sp: sp.k_scale) if quantized else None
    vs = addresses(lambda sp: sp.v_scale) if quantized else None
    ids = np.concatenate([b for b, _ in tables])
    at = np.cumsum([0] + [len(b) for b, _ in tables[:-1]])
    table_at = (ids.ctypes.data + ids.itemsize * at).astype(np.uint64)
    block = np.array([size for _, size in tables], dtype=np.int64)
    return StepArgs(t, pos.astype(np.int64), seq, k, v, ks, vs, 2 if q4 else int(quantized),
                    table_at, block, ids)


# the cache layers (and scales) found good, by id: (the tensor, its shape after the first
# dimension, its dtype); a step checks the same 2 x layers tensors again and again, and their
# checks were half a decode step's Python (dtype, device, shape and layout cannot change
# under a tensor object)
_GOOD_CACHES: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, ...], torch.dtype]] = {}


def _check_cache(c: torch.Tensor, tail: tuple[int, ...], dtype: torch.dtype) -> None:
    """A cache layer is [rows, *tail] `dtype` ([rows, n_kv_heads, head_dim] halves or int8,
    or a scale layer [rows, n_kv_heads] float32), contiguous, on the CPU."""
    known = _GOOD_CACHES.get(id(c))
    if known is not None and known[0]() is c and known[1:] == (tail, dtype):
        return
    _check(c, "cache", dtype, len(tail) + 1)
    if tuple(c.shape[1:]) != tail:
        raise ValueError(f"a cache layer {tuple(c.shape)} is not [rows, "
                         f"{', '.join(map(str, tail))}]")  # fmt: skip
    key = id(c)
    gone = lambda _: _GOOD_CACHES.pop(key, None)  # noqa: E731
    _GOOD_CACHES[key] = (weakref.ref(c, gone), tail, dtype)


_ONE_BLOCK = np.zeros(1, dtype=np.int32)  # a contiguous cache's table


def _block_table(sp: CacheSpan, rows: int) -> tuple[np.ndarray, int]:
    """The span's block ids as C reads them (int32, as many as its positions need) and its
    block size, checked against its caches' `rows`; a contiguous cache is one block, 0, of
    all its positions (row p: position p)."""
    end = sp.start + sp.length
    if sp.table is None:
        if sp.block_size:
            raise ValueError(f"block_size {sp.block_size} without a table")
        if rows < end:
            raise ValueError(f"a cache layer of {rows} rows cannot hold {end} positions")
        return _ONE_BLOCK, end
    size = sp.block_size
    if size < 8 or size & (size - 1):
        raise ValueError(f"block_size {size} must be a power of two >= 8")
    table = sp.table.cpu().numpy() if isinstance(sp.table, torch.Tensor) else sp.table
    if table.ndim != 1 or table.dtype.kind not in "iu":
        raise ValueError(f"a block table is 1-D integers, got {table.dtype} {table.shape}")
    need = -(-end // size)
    if len(table) < need:
        raise ValueError(f"a table of {len(table)} blocks of {size} cannot hold {end} positions")
    if rows % size:
        raise ValueError(f"a pool layer of {rows} rows is not whole blocks of {size}")
    used = table[:need]
    if used.min() < 0 or used.max() >= rows // size:
        raise ValueError(f"block ids {used.min()} .. {used.max()} outside the pool's "
                         f"{rows // size} blocks")  # fmt: skip
    return used.astype(np.int32), size


def _check_writes(spans: Sequence[CacheSpan], tables: Sequence[tuple[np.ndarray, int]]) -> None:
    """A block a paged span writes into (one of positions start .. start + length - 1 is in it)
    appears once in the call's tables of its pool: else two tokens would write one row at
    once, or one would read a row another writes. Blocks only read (a common prefix's) may be
    in several tables."""
    pools: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for sp, (ids, size) in zip(spans, tables, strict=True):
        if sp.table is not None and sp.k:
            used, written = pools.setdefault(sp.k[0].data_ptr(), ([], []))
            used.append(ids)
            written.append(ids[sp.start // size :])
    for used, written in pools.values():
        every, w = np.sort(np.concatenate(used)), np.concatenate(written)
        twice = np.searchsorted(every, w, "right") - np.searchsorted(every, w, "left") > 1
        if twice.any():
            raise ValueError(f"block {w[twice][0]} is written by a span and in the call's "
                             f"tables more than once")  # fmt: skip
