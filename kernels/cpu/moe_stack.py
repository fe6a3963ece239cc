"""A stack of MoE transformer layers in one call of the CPU kernels (`kernels/cpu/moe_layers.h`).

The algorithm is the torch forward's (`stratad/engine/reference/forward.py` with
`weights_mode.QuantWeights`, the reference this is tested against) for Qwen3-MoE's layers:
RMSNorm, q/k/v products, bias, per-head q/k RMSNorm, RoPE, causal GQA attention over the half
cache, o product, residual, RMSNorm, the router's softmax top-k, the routed SwiGLU experts
from the model's stacks, their weighted sum, residual. A decode step is one C call instead of
some 700 torch ops and ctypes calls (`moe_layers.h` says what that cost).

Tensors in, checked once here (`MoEStack`: the weights; each call: x, the cache, RoPE's
tables, as `cpu_dense`); pointers to the C side. Each call returns the experts every token
was routed to, for the engine's routing counts.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.dense import MAX_HEAD_DIM, CacheSpan, check_step
from kernels.cpu.experts import X8, CpuExperts, _check
from kernels.cpu.file_pages import FileMappings
from kernels.cpu.team import TeamSize
from kernels.formats.quant import QType

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
WEIGHTS = ("q", "k", "v", "o", "router", "gate", "up", "down")  # moe_layer_t's w[] order


class _Layer(ctypes.Structure):  # moe_layer_t
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("bias", _P * 3), ("q_norm", _P),
                ("k_norm", _P), ("w", _P * 8), ("qtype", _I32 * 8), ("experts", _P),
                ("codes", _P)]  # fmt: skip


class _Dims(ctypes.Structure):  # moe_dims_t
    _fields_ = [("hidden", _I64), ("n_heads", _I64), ("n_kv_heads", _I64), ("head_dim", _I64),
                ("n_experts", _I64), ("top_k", _I64), ("ffn", _I64),
                ("rope_interleaved", _I32), ("norm_topk", _I32), ("eps", _F),
                ("kv_format", _I32)]  # fmt: skip


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    ffn: int  # each expert's
    rope_interleaved: bool
    norm_topk: bool  # the top k's weights renormalized to sum 1
    eps: float

    def rows_cols(self) -> dict[str, tuple[int, int]]:
        """Each weight's [rows, cols] (an expert stack's per expert)."""
        h, f = self.hidden, self.ffn
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "router": (self.n_experts, h),
                "gate": (f, h), "up": (f, h), "down": (h, f)}  # fmt: skip


@dataclass(frozen=True)
class MoELayer:
    """One layer's tensors: norms [H] float32; q/k norms [D] float32 or None; each weight's GGUF
    blocks and type in `WEIGHTS` order (the expert stacks [E, rows, cols] blocks); q/k/v biases
    float32 or None."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    weights: tuple[tuple[torch.Tensor | None, QType], ...]  # expert stacks None: place_experts
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _vector(t: torch.Tensor | None, name: str, n: int) -> int | None:
    if t is None:
        return None
    _check(t, name, torch.float32, 1)
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} values, not {n}")
    return t.data_ptr()


class MoEStack:
    """x [T, H] float32 through every layer, in place, with one kernel call."""

    def __init__(self, kernels: CpuExperts, shape: MoEShape, layers: Sequence[MoELayer]) -> None:
        d, heads, kv = shape.head_dim, shape.n_heads, shape.n_kv_heads
        if d % 2 or d > MAX_HEAD_DIM or heads % kv:
            raise ValueError(f"head_dim {d} must be even and <= {MAX_HEAD_DIM}, and {heads} "
                             f"heads a multiple of {kv} kv heads")  # fmt: skip
        if not 1 <= shape.top_k <= shape.n_experts:
            raise ValueError(f"top_k {shape.top_k} of {shape.n_experts} experts")
        dims = shape.rows_cols()
        self.shape, self.layers = shape, list(layers)  # the tensors stay alive with the stack
        # attention and router weights as the kernels read them (`CpuExperts.interleave`);
        # the expert stacks stay in their GGUF rows
        self._read: list[torch.Tensor] = []
        files = FileMappings.now()
        self._c_layers = (_Layer * len(layers))()
        for c, layer in zip(self._c_layers, layers, strict=True):
            c.attn_norm = _vector(layer.attn_norm, "attn_norm", shape.hidden)
            c.ffn_norm = _vector(layer.ffn_norm, "ffn_norm", shape.hidden)
            c.q_norm, c.k_norm = (_vector(t, name, d) for t, name in
                                  ((layer.q_norm, "q_norm"), (layer.k_norm, "k_norm")))  # fmt: skip
            for i, (name, (w, qtype)) in enumerate(zip(WEIGHTS, layer.weights, strict=True)):
                rows, cols = dims[name]
                stacked = name in ("gate", "up", "down")
                kernels._qtype(qtype, name)
                if w is None and stacked:  # addressed per expert (place_experts) before a call
                    c.w[i], c.qtype[i] = None, int(qtype)
                    continue
                if w is None:
                    raise ValueError(f"{name}: no weight")
                if stacked:
                    kernels._check_weight(w, qtype, rows * shape.n_experts, cols)
                    c.w[i], c.qtype[i] = w.data_ptr(), int(qtype)
                    continue
                read, code = kernels.interleave(w, qtype, rows, cols, files)
                self._read.append(read)
                c.w[i], c.qtype[i] = read.data_ptr(), code
            for i, (name, b) in enumerate(zip(WEIGHTS[:3], layer.biases, strict=True)):
                c.bias[i] = _vector(b, f"{name} bias", dims[name][0])
        self._dims = _Dims(shape.hidden, shape.n_heads, shape.n_kv_heads, shape.head_dim,
                           shape.n_experts, shape.top_k, shape.ffn, int(shape.rope_interleaved),
                           int(shape.norm_topk), shape.eps)  # fmt: skip
        self._fn, self._tables = kernels._moe_layers, kernels._tables
        self.team = TeamSize(kernels.threads)  # measured per call shape (kernels/cpu/team.py)
        # place_experts' tables, kept alive here
        self._tables_in_use: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def __call__(
        self, x: torch.Tensor, spans: Sequence[CacheSpan], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] (in place), the spans and tables as `DenseStack`'s; the experts each token
        was routed to, [layers, T, top_k] int64 (largest weight first)."""
        s, n = self.shape, len(self.layers)
        if any(not c.w[5] and not c.experts for c in self._c_layers):
            raise ValueError("a layer without expert stacks needs place_experts before a call")
        a = check_step(x, spans, cos, sin, s.hidden, s.n_kv_heads, s.head_dim, n)
        pos, seq, kp, vp, ksp, vsp, tp, bp = a.pointers()
        self._dims.kv_format = a.kv_format
        ids = torch.empty((n, a.tokens, s.top_k), dtype=torch.int32)
        threads = self.team.pick(a.tokens)
        t0 = time.perf_counter()
        rc = self._fn(x.data_ptr(), a.tokens, pos, seq, ctypes.addressof(self._c_layers), n,
                      ctypes.byref(self._dims), kp, vp, ksp, vsp, tp, bp, cos.data_ptr(),
                      sin.data_ptr(), ids.data_ptr(), threads, self._tables.data_ptr())  # fmt: skip
        self.team.record(a.tokens, threads, time.perf_counter() - t0)
        CpuExperts._raise(rc, "MoE layers")
        return ids.long()

    def place_experts(
        self, layer: int, table: np.ndarray | None, codes: np.ndarray | None = None
    ) -> None:
        """Layer `layer`'s experts read from `table` ([E, 3] uint64: expert e's gate, up and
        down addresses; the caller keeps that memory alive and the table unchanged until the
        next call) instead of the stacks; None: the stacks again. Each part is GGUF blocks in
        its stack's type, or with `codes` ([E, 3] int32) in the type each code names: the
        stack's, or the stack's with `X8` (rows interleaved in eights: `CpuExperts.interleave`,
        an expert store's RAM copy)."""
        c = self._c_layers[layer]
        if table is None:
            c.experts = c.codes = None
            self._tables_in_use.pop(layer, None)
            return
        shape = (self.shape.n_experts, 3)
        if table.dtype != np.uint64 or table.shape != shape:
            raise ValueError(f"an expert table is [{shape[0]}, 3] uint64, got {table.dtype}"
                             f" {table.shape}")  # fmt: skip
        if not table.flags.c_contiguous or not table.all():
            raise ValueError("an expert table must be contiguous and hold no null address")
        if codes is not None:
            if codes.dtype != np.int32 or codes.shape != shape or not codes.flags.c_contiguous:
                raise ValueError(f"expert type codes are [{shape[0]}, 3] contiguous int32, got"
                                 f" {codes.dtype} {codes.shape}")  # fmt: skip
            stacks = np.array(c.qtype[5:8], dtype=np.int32)
            if not np.all((codes == stacks) | (codes == (stacks | X8))):
                raise ValueError("an expert's type code is neither its stack's type nor that"
                                 " type interleaved")  # fmt: skip
            if np.all(codes == stacks):  # the stacks' types: no per-expert matrix in the call
                codes = None
        self._tables_in_use[layer] = (table, codes)
        c.experts = table.ctypes.data
        c.codes = None if codes is None else codes.ctypes.data
