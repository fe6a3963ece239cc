"""A stack of dense transformer layers in one call of the CPU kernels (`kernels/cpu/dense.h`).

The algorithm is the torch forward's (`stratad/engine/forward.py` with
`weights_mode.QuantWeights`, the reference this is tested against): RMSNorm, q/k/v products,
bias, RoPE, causal GQA attention (each token over its keys, as decode computes it), o product,
residual, RMSNorm, SwiGLU, residual. In C, every layer of a step runs in one OpenMP team with
no Python between the pieces; q/k/v (and gate/up) are one task list over a shared int8 copy
of their input; a prompt's tokens go through each weight row together.

Tensors in, checked once here (`DenseStack`: the weights; each call: x, the cache, RoPE's
tables); pointers to the C side.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu_experts import CpuExperts, _check
from kernels.cpu_team import TeamSize
from kernels.quant import QType

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
        self.team = TeamSize(kernels.threads)  # measured per call shape (kernels/cpu_team.py)

    def __call__(
        self,
        x: torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """x [T, H] (in place); the tokens sit at positions start..start+T-1, their keys and
        values go into k_cache[l], v_cache[l] [>= start + T, Hkv, D] `CACHE_DTYPE`; cos, sin
        [T, D/2] float32 (`layers.rope_tables`)."""
        s = self.shape
        t = check_step(x, k_cache, v_cache, start, cos, sin, s.hidden, s.n_kv_heads, s.head_dim,
                       len(self.layers))  # fmt: skip
        kp = np.array([c.data_ptr() for c in k_cache], dtype=np.uint64)
        vp = np.array([c.data_ptr() for c in v_cache], dtype=np.uint64)
        threads = self.team.pick(t)
        t0 = time.perf_counter()
        rc = self._fn(x.data_ptr(), t, start, ctypes.addressof(self._c_layers), len(self.layers),
                      ctypes.byref(self._dims), kp.ctypes.data, vp.ctypes.data, cos.data_ptr(),
                      sin.data_ptr(), threads, self._tables.data_ptr())  # fmt: skip
        self.team.record(t, threads, time.perf_counter() - t0)
        CpuExperts._raise(rc, "dense layers")


def check_step(
    x: torch.Tensor,
    k_cache: Sequence[torch.Tensor],
    v_cache: Sequence[torch.Tensor],
    start: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hidden: int,
    n_kv_heads: int,
    head_dim: int,
    n_layers: int,
) -> int:
    """A layers call's tensors checked (x [T, hidden] float32, the caches, RoPE's tables); T."""
    _check(x, "x", torch.float32, 2)
    t = x.shape[0]
    if x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    for name, tab in (("cos", cos), ("sin", sin)):
        _check(tab, name, torch.float32, 2)
        if tuple(tab.shape) != (t, head_dim // 2):
            raise ValueError(f"{name} must be [{t}, {head_dim // 2}], got {tuple(tab.shape)}")
    if len(k_cache) != n_layers or len(v_cache) != n_layers:
        raise ValueError(f"{len(k_cache)} and {len(v_cache)} cache layers for {n_layers} layers")
    for c in (*k_cache, *v_cache):
        _check(c, "cache", CACHE_DTYPE, 3)
        if c.shape[0] < start + t or tuple(c.shape[1:]) != (n_kv_heads, head_dim):
            raise ValueError(f"a cache layer {tuple(c.shape)} cannot hold {start + t} "
                             f"positions of [{n_kv_heads}, {head_dim}]")  # fmt: skip
    return t
