"""MoE experts and dense matmuls on the CPU, read straight from GGUF blocks.

The C kernels (`kernels/cpu/experts.c`, built at first use by `kernels.cpu.build`) quantize
each activation to int8 in blocks of 32 (as llama.cpp's Q8_0) and take integer dot products
with the weight blocks, multi-threaded with OpenMP. A ctypes call releases the GIL, so the
CPU computes experts while Python queues GPU work. One `moe` call computes all of a layer's
CPU items (gate/up rows of every item in parallel, then down rows), and the sum into `out` is
in item order: the result does not depend on the thread count.

Tensors in, checked here (shapes, dtypes, contiguity, device); pointers to the C side.
Every call runs `threads` OpenMP threads until all are done, so a team larger than the cores
left free by other busy threads waits on the preempted one (on the 2-core VM, a 2-thread call
beside one busy process ran at a 1-thread call's rate): give it the free cores. Rates per type:
bench/cpu/cpu_experts.py, bench/results/2026-12-04-cpu-experts-2core.md.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from kernels.cpu.build import SOURCE_DIR, load
from kernels.cpu.file_pages import FileMappings
from kernels.cpu.team import TeamSize
from kernels.formats.iq_tables import iq_tables
from kernels.formats.quant import QType, row_bytes

CPU_EXPERT_QTYPES: frozenset[QType] = frozenset(
    {
        QType.F32, QType.F16, QType.BF16,
        QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL,
        QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.IQ3_S,
        QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.MXFP4,
    }
)  # fmt: skip
# the types the kernels read with rows interleaved in eights (kernels/cpu/interleave.h's
# x8_kind, which sizes the layout: `strata_interleaved_bytes`)
INTERLEAVED_QTYPES: frozenset[QType] = frozenset(
    {QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q4_K, QType.Q6_K}
)
X8 = 1 << 10  # or'ed into a type code: the matrix is interleaved (interleave.h's X8_FLAG)
_ERRORS = {-1: "unsupported type", -2: "columns not a multiple of the block", -3: "out of memory"}
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@dataclass(frozen=True)
class CpuExpertFormat:
    """One layer's expert blob: [gate | up | down] contiguous bytes.

    gate/up are [ffn, hidden] and down is [hidden, ffn] in their GGUF blocks; q4_0_split: the
    Q4_0 projections are in `kernels.experts.moe.split_q4_0`'s layout, q6_k_split: the Q6_K
    ones in `split_q6_k`'s, mxfp4_split: the MXFP4 ones in `split_mxfp4`'s (each the same
    size)."""

    qtypes: tuple[QType, QType, QType]  # gate, up, down
    hidden: int
    ffn: int
    up_offset: int
    down_offset: int
    q4_0_split: bool
    q6_k_split: bool = False
    mxfp4_split: bool = False

    @classmethod
    def packed(
        cls, qtypes: tuple[QType, QType, QType], hidden: int, ffn: int, q4_0_split: bool = False,
        q6_k_split: bool = False, mxfp4_split: bool = False,
    ) -> CpuExpertFormat:  # fmt: skip
        """The format of a blob with the three matrices back to back."""
        gate = ffn * row_bytes(qtypes[0], hidden)
        up = ffn * row_bytes(qtypes[1], hidden)
        return cls(qtypes, hidden, ffn, gate, gate + up, q4_0_split, q6_k_split, mxfp4_split)

    @property
    def split_bits(self) -> int:
        """The C kernels' `split`: bit 0 Q4_0 split, bit 1 Q6_K split, bit 2 MXFP4 split."""
        return int(self.q4_0_split) | int(self.q6_k_split) << 1 | int(self.mxfp4_split) << 2

    @property
    def nbytes(self) -> int:
        """The bytes of one blob (its down projection's end)."""
        return self.down_offset + self.hidden * row_bytes(self.qtypes[2], self.ffn)


@dataclass(frozen=True)
class ExpertExtras:
    """What a layer's experts add to silu(gate x) * up x (gpt-oss): each item's gate and up
    biases [n, 2, ffn] and down bias [n, hidden] (float32 CPU tensors, row i for item i, or
    None), and the clamped SwiGLU's (alpha, limit) in place of SiLU (None: SiLU)."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    clamp: tuple[float, float] | None = None

    def args(self, n: int, hidden: int, ffn: int) -> tuple[int | None, int | None, float, float]:
        """The C kernels' (gu_bias, down_bias, alpha, limit) for n items, checked."""
        for t, shape, name in ((self.gate_up_bias, (n, 2, ffn), "gate_up_bias"),
                               (self.down_bias, (n, hidden), "down_bias")):  # fmt: skip
            if t is not None:
                _check(t, name, torch.float32)
                if tuple(t.shape) != shape:
                    raise ValueError(f"{name} {tuple(t.shape)}: not {list(shape)}")
        alpha, limit = self.clamp or (1.0, 0.0)
        if self.clamp is not None and not limit > 0:
            raise ValueError(f"the clamp's limit must be positive, got {limit}")
        return (
            None if self.gate_up_bias is None else self.gate_up_bias.data_ptr(),
            None if self.down_bias is None else self.down_bias.data_ptr(),
            alpha,
            limit,
        )


PLAIN = ExpertExtras()


def physical_cores() -> int:
    """The default team size: the physical cores this process may run on."""
    usable = len(os.sched_getaffinity(0))
    return max(1, min(psutil.cpu_count(logical=False) or usable, usable))


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, ndim: int | None = None) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


class CpuExperts:
    """The compiled kernels, loaded once; `threads` is the OpenMP team size of every call."""

    supported: frozenset[QType] = CPU_EXPERT_QTYPES

    def __init__(
        self,
        threads: int | None = None,
        cache_dir: Path | None = None,
        *,
        native: bool = True,
        interleave: bool = True,
        source: Path = SOURCE_DIR,
    ) -> None:
        """Build (first use) and load the kernels; `CpuKernelsUnavailable` if they cannot be.
        native=False: without -march=native (the portable C paths; for tests). interleave:
        dense weights of `INTERLEAVED_QTYPES` are copied into rows interleaved in eights where
        the build has those dots (`interleave`); off: read in their GGUF layout. source: the
        C sources' folder (another commit's, with the same functions, for an A/B in one
        process: `bench.cpu.ab_kernels`)."""
        self.threads = threads if threads is not None else physical_cores()
        self.native = native
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        lib = load(cache_dir, native, source)
        self._matmul = lib.strata_matmul
        self._matmul.argtypes = [_P, _I64, _P, _I32, _I32, _I64, _I64, _P, _I32, _P]
        self._moe = lib.strata_moe
        self._moe.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I32, _P,
                              _I32, _P, _P, _P, _F, _F]  # fmt: skip
        self._moe_parts = lib.strata_moe_parts
        self._moe_parts.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _I32, _P,
                                    _I32, _P, _P, _P, _F, _F]  # fmt: skip
        self._dense = lib.strata_dense_layers  # kernels/cpu/dense.py
        self._dense.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                _I32, _P]  # fmt: skip
        self._moe_layers = lib.strata_moe_layers  # kernels/cpu/moe_stack.py
        self._moe_layers.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P,
                                     _P, _P, _P, _I32, _P]  # fmt: skip
        for fn in (self._matmul, self._moe, self._moe_parts, self._dense, self._moe_layers):
            fn.restype = ctypes.c_int
        self._interleave = lib.strata_interleave
        self._interleave.argtypes = [_P, _I32, _I64, _I64, _P, _I32]
        self._interleave.restype = _I32
        self._interleaved_bytes = lib.strata_interleaved_bytes
        self._interleaved_bytes.argtypes, self._interleaved_bytes.restype = [_I32, _I64, _I64], _I64
        self.interleaves = interleave and bool(lib.strata_interleaved_dots())
        self._read = lib.strata_read
        self._read.argtypes, self._read.restype = [_P, _I64, _I32], ctypes.c_uint64
        self._tables = iq_tables(torch.device("cpu"))  # [SIZE] uint8, kept alive here

    def read(self, data: torch.Tensor) -> int:
        """Sum `data`'s bytes as 64-bit words with all threads: a probe of the read bandwidth
        the kernels see (bench/cpu/cpu_experts.py)."""
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("data must be a contiguous CPU tensor")
        words = data.numel() * data.element_size() // 8
        return int(self._read(data.data_ptr(), words, self.threads))

    def _qtype(self, qtype: QType, name: str) -> None:
        if qtype not in self.supported:
            raise ValueError(f"the CPU kernels do not read {QType(qtype).name} ({name})")

    @staticmethod
    def _raise(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"CPU kernel {what}: {_ERRORS.get(rc, f'error {rc}')}")

    def _check_weight(self, w: torch.Tensor, qtype: QType, rows: int, cols: int) -> None:
        self._qtype(qtype, "matmul")
        if w.device.type != "cpu" or not w.is_contiguous():
            raise ValueError("w must be a contiguous CPU tensor")
        need = rows * row_bytes(qtype, cols)
        if w.numel() * w.element_size() != need:
            raise ValueError(
                f"w holds {w.numel() * w.element_size()} bytes, a [{rows}, {cols}] "
                f"{QType(qtype).name} matrix {need}"
            )
        if cols % 32:
            raise ValueError(f"cols must be a multiple of 32, got {cols}")

    def interleaved_bytes(self, qtype: QType, rows: int, cols: int) -> int:
        """The bytes of a [rows, cols] weight of qtype with rows interleaved in eights; < 0
        where it has no such layout (its type, or rows not in eights)."""
        return int(self._interleaved_bytes(int(qtype), rows, cols))

    def interleave(
        self,
        w: torch.Tensor,
        qtype: QType,
        rows: int,
        cols: int,
        files: FileMappings | None = None,
    ) -> tuple[torch.Tensor, int]:
        """A checked weight as the kernels read it fastest, and its C type code: a copy with
        rows interleaved in eights (`kernels/cpu/interleave.h`; the code has `X8` set) where
        this build has those dots and the type and rows allow, else w itself and its type.
        With `files`, a copied w's pages are given back where it lies in a read-only file
        mapping (`kernels/cpu/file_pages.py`): the process holds the copy, not both."""
        self._check_weight(w, qtype, rows, cols)
        nbytes = self.interleaved_bytes(qtype, rows, cols) if self.interleaves else -1
        if nbytes < 0:
            return w, int(qtype)
        out = torch.empty(nbytes, dtype=torch.uint8)
        code = self._interleave_checked(w, qtype, rows, cols, out, self.threads)
        if code == int(qtype):
            return w, code
        if files is not None:
            files.release(w)
        return out, code

    def interleave_into(
        self, w: torch.Tensor, qtype: QType, rows: int, cols: int, out: torch.Tensor, threads: int
    ) -> int:
        """w's rows interleaved in eights written to out (uint8, at least `interleaved_bytes`;
        the caller checks first that the layout exists), by `threads` threads; the C type code
        of what out holds: qtype with `X8` set, or qtype itself where a Q4_0 scale is too
        large for the layout's fp16 offset (then out holds w's GGUF bytes, copied)."""
        self._check_weight(w, qtype, rows, cols)
        nbytes = self.interleaved_bytes(qtype, rows, cols)
        fits = out.dtype == torch.uint8 and out.is_contiguous() and out.numel() >= nbytes
        if nbytes < 0 or not fits:
            raise ValueError(f"no room or no interleaved layout for a [{rows}, {cols}] "
                             f"{QType(qtype).name} matrix in {out.numel()} bytes")  # fmt: skip
        return self._interleave_checked(w, qtype, rows, cols, out, threads)

    def _interleave_checked(
        self, w: torch.Tensor, qtype: QType, rows: int, cols: int, out: torch.Tensor, threads: int
    ) -> int:
        """`interleave_into` once w and out are checked."""
        rc = self._interleave(w.data_ptr(), int(qtype), rows, cols, out.data_ptr(), threads)
        if rc == -4:  # a Q4_0 scale too large for its offset in fp16: the GGUF layout serves
            out[: w.numel()].copy_(w.view(torch.uint8).reshape(-1))
            return int(qtype)
        self._raise(rc, "interleave")
        return int(qtype) | X8

    def prepare(self, w: torch.Tensor, qtype: QType, rows: int, cols: int) -> PreparedMatmul:
        """`matmul` by one weight, checked once (a dense layer's projection, called per
        token)."""
        self._check_weight(w, qtype, rows, cols)
        return PreparedMatmul(self, w, qtype, rows, cols)

    def prepare_moe(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
        qtypes: tuple[QType, QType, QType], hidden: int, ffn: int,
    ) -> PreparedMoE:  # fmt: skip
        """A layer's routed experts from its stacks (GGUF blocks [E, ffn, hidden] gate and up,
        [E, hidden, ffn] down), checked once: `PreparedMoE`."""
        n = gate.shape[0]
        for w, qtype, rows, cols in ((gate, qtypes[0], ffn, hidden), (up, qtypes[1], ffn, hidden),
                                     (down, qtypes[2], hidden, ffn)):  # fmt: skip
            if w.shape[0] != n:
                raise ValueError(f"{w.shape[0]} experts in one stack, {n} in another")
            self._check_weight(w, qtype, n * rows, cols)
        return PreparedMoE(self, (gate, up, down), qtypes, hidden, ffn)

    def matmul(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        qtype: QType,
        rows: int,
        cols: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, cols] float32 @ W^T -> [T, rows] float32; W is GGUF blocks [rows, cols]
        (uint8, or for F32/F16/BF16 the float tensor itself)."""
        self._check_weight(w, qtype, rows, cols)
        _check(x, "x", torch.float32, 2)
        if x.shape[1] != cols:
            raise ValueError(f"x has {x.shape[1]} columns, the weight {cols}")
        if out is None:
            out = torch.empty((x.shape[0], rows), dtype=torch.float32)
        _check(out, "out", torch.float32, 2)
        if tuple(out.shape) != (x.shape[0], rows):
            raise ValueError(f"out must be [{x.shape[0]}, {rows}], got {tuple(out.shape)}")
        rc = self._matmul(x.data_ptr(), x.shape[0], w.data_ptr(), int(qtype), 0, rows, cols,
                          out.data_ptr(), self.threads, self._tables.data_ptr())  # fmt: skip
        self._raise(rc, "matmul")
        return out

    def moe(
        self,
        x: torch.Tensor,
        blobs: Sequence[torch.Tensor],
        tokens: Sequence[int],
        weights: Sequence[float],
        fmt: CpuExpertFormat,
        out: torch.Tensor,
        extras: ExpertExtras = PLAIN,
    ) -> None:
        """out[tokens[i]] += weights[i] * down_i(silu(gate_i x) * up_i x), x [T, hidden] and
        out [T, hidden] float32; blobs[i] is item i's expert (uint8, >= fmt.nbytes, any
        alignment). Items sharing a blob (the same tensor storage) read it once. `extras`:
        the items' biases and gpt-oss's clamped SwiGLU."""
        for qtype, name in zip(fmt.qtypes, ("gate", "up", "down"), strict=True):
            self._qtype(qtype, name)
        if fmt.hidden % 32 or fmt.ffn % 32:
            raise ValueError(f"hidden {fmt.hidden} and ffn {fmt.ffn} must be multiples of 32")
        _check(x, "x", torch.float32, 2)
        _check(out, "out", torch.float32, 2)
        n_tokens = x.shape[0]
        if x.shape[1] != fmt.hidden or tuple(out.shape) != tuple(x.shape):
            raise ValueError(
                f"x {tuple(x.shape)} and out {tuple(out.shape)} must both be [T, {fmt.hidden}]"
            )
        n = len(blobs)
        if len(tokens) != n or len(weights) != n:
            raise ValueError(f"{n} blobs, {len(tokens)} tokens, {len(weights)} weights")
        if n == 0:
            return
        nbytes = fmt.nbytes
        for i, blob in enumerate(blobs):
            if blob.device.type != "cpu" or blob.dtype != torch.uint8 or not blob.is_contiguous():
                raise ValueError(f"blob {i} must be a contiguous uint8 CPU tensor")
            if blob.numel() < nbytes:
                raise ValueError(f"blob {i} holds {blob.numel()} bytes, the format {nbytes}")
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.min() < 0 or tok.max() >= n_tokens:
            raise ValueError(f"tokens must be in [0, {n_tokens}), got {tokens}")
        ptrs = np.array([b.data_ptr() for b in blobs], dtype=np.uint64)
        wts = np.asarray(weights, dtype=np.float32)
        qts = np.array([int(q) for q in fmt.qtypes], dtype=np.int32)
        rc = self._moe(
            x.data_ptr(), n_tokens, fmt.hidden, fmt.ffn, ptrs.ctypes.data, n, tok.ctypes.data,
            wts.ctypes.data, qts.ctypes.data, fmt.up_offset, fmt.down_offset, fmt.split_bits,
            out.data_ptr(), self.threads, self._tables.data_ptr(),
            *extras.args(n, fmt.hidden, fmt.ffn),
        )  # fmt: skip
        self._raise(rc, "moe")

    def moe_parts(
        self,
        x: torch.Tensor,
        experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        tokens: Sequence[int],
        weights: Sequence[float],
        qtypes: tuple[QType, QType, QType],
        ffn: int,
        out: torch.Tensor,
        extras: ExpertExtras = PLAIN,
    ) -> None:
        """`moe` where item i's expert is three tensors of GGUF bytes (gate [ffn, hidden], up
        [ffn, hidden], down [hidden, ffn], anywhere: a blob's slices, or a mapped file's
        stacks). Items whose gate is the same memory read it once."""
        hidden = x.shape[1] if x.dim() == 2 else 0
        _check(x, "x", torch.float32, 2)
        _check(out, "out", torch.float32, 2)
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} differ")
        shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
        for (_, cols), qtype, name in zip(shapes, qtypes, ("gate", "up", "down"), strict=True):
            self._qtype(qtype, name)
            if cols % 32:
                raise ValueError(f"{name}: {cols} columns, not a multiple of 32")
        n = len(experts)
        if len(tokens) != n or len(weights) != n:
            raise ValueError(f"{n} experts, {len(tokens)} tokens, {len(weights)} weights")
        if n == 0:
            return
        sizes = [rows * row_bytes(q, cols) for (rows, cols), q in zip(shapes, qtypes, strict=True)]
        ptrs = np.empty((3, n), dtype=np.uint64)
        for i, parts in enumerate(experts):
            for j, (part, size) in enumerate(zip(parts, sizes, strict=True)):
                if part.device.type != "cpu" or not part.is_contiguous() or part.nbytes < size:
                    raise ValueError(f"expert {i} part {j}: not {size} contiguous CPU bytes")
                ptrs[j, i] = part.data_ptr()
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.min() < 0 or tok.max() >= x.shape[0]:
            raise ValueError(f"tokens must be in [0, {x.shape[0]}), got {tokens}")
        wts = np.asarray(weights, dtype=np.float32)
        qts = np.array([int(q) for q in qtypes], dtype=np.int32)
        rc = self._moe_parts(x.data_ptr(), x.shape[0], hidden, ffn, ptrs[0].ctypes.data,
                             ptrs[1].ctypes.data, ptrs[2].ctypes.data, n, tok.ctypes.data,
                             wts.ctypes.data, qts.ctypes.data, 0, out.data_ptr(), self.threads,
                             self._tables.data_ptr(), *extras.args(n, hidden, ffn))  # fmt: skip
        self._raise(rc, "moe")


# below this many weights times tokens a product runs on one thread: waking the team costs
# more than it saves (a [192, 576] product: 25 us on one thread, 45-130 on two busy cores)
ONE_THREAD_WEIGHTS = 1 << 18


class PreparedMatmul:
    """x [T, cols] float32 @ W^T -> [T, rows] float32 for one weight checked at `prepare`:
    each call checks x's shape and type only. A product large enough for the team runs on
    the team size measured fastest for its token count (`kernels.cpu.team`: a busy host's)."""

    def __init__(self, kernels: CpuExperts, w: torch.Tensor, qtype: QType, rows: int,
                 cols: int) -> None:  # fmt: skip
        self.w, self.qtype, self.rows, self.cols = w, qtype, rows, cols
        self._kernels, self._fn, self._tables = kernels, kernels._matmul, kernels._tables
        self._read: tuple[torch.Tensor, int] | None = None  # w as the kernels read it
        self.team = TeamSize(kernels.threads)

    def _weight(self) -> tuple[torch.Tensor, int]:
        """The weight as the kernels read it and its C type code, made at the first product
        (`CpuExperts.interleave`: a layer's projections that a one-call stack runs instead
        are never copied)."""
        if self._read is None:
            self._read = self._kernels.interleave(self.w, self.qtype, self.rows, self.cols,
                                                  FileMappings.now())  # fmt: skip
        return self._read

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x must be float32 [T, {self.cols}], got {x.dtype} {tuple(x.shape)}")
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("x must be a contiguous CPU tensor")
        t = x.shape[0]
        out = torch.empty((t, self.rows), dtype=torch.float32)
        small = t * self.rows * self.cols < ONE_THREAD_WEIGHTS
        threads = 1 if small else self.team.pick(t)
        t0 = time.perf_counter()
        w, code = self._weight()
        rc = self._fn(x.data_ptr(), t, w.data_ptr(), code, 0, self.rows, self.cols,
                      out.data_ptr(), threads, self._tables.data_ptr())  # fmt: skip
        if not small:
            self.team.record(t, threads, time.perf_counter() - t0)
        CpuExperts._raise(rc, "matmul")
        return out


class PreparedMoE:
    """out[t] += sum_k weights[t, k] * expert ids[t, k](x[t]) for one layer's expert stacks
    checked at `prepare_moe`: all of a step's routed experts in one `moe` kernel call."""

    def __init__(self, kernels: CpuExperts, stacks: tuple[torch.Tensor, ...],
                 qtypes: tuple[QType, QType, QType], hidden: int, ffn: int) -> None:  # fmt: skip
        self.stacks, self.hidden, self.ffn, self.n_experts = stacks, hidden, ffn, stacks[0].shape[0]
        # the start of each expert's matrix in each stack
        self._ptrs = [np.array([s[e].data_ptr() for e in range(self.n_experts)], dtype=np.uint64)
                      for s in stacks]  # fmt: skip
        self._qtypes = np.array([int(q) for q in qtypes], dtype=np.int32)
        self._fn, self._tables, self._threads = kernels._moe_parts, kernels._tables, kernels.threads

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor, extras: ExpertExtras = PLAIN) -> None:  # fmt: skip
        """x, out [T, hidden] float32; ids [T, k] expert ids, weights [T, k] float32; `extras`:
        the items' (ids in row order) biases and clamped SwiGLU."""
        _check(x, "x", torch.float32, 2)
        _check(out, "out", torch.float32, 2)
        t = x.shape[0]
        if x.shape[1] != self.hidden or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"x {tuple(x.shape)}, out {tuple(out.shape)}: not [T, {self.hidden}]")
        if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != t:
            raise ValueError(f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}: no [{t}, k]")
        e = ids.reshape(-1).numpy().astype(np.int64)
        if e.size and (e.min() < 0 or e.max() >= self.n_experts):
            raise ValueError(f"expert ids must be in [0, {self.n_experts})")
        tokens = np.repeat(np.arange(t, dtype=np.int64), ids.shape[1])
        wts = weights.reshape(-1).float().numpy().astype(np.float32)
        gates, ups, downs = (p[e] for p in self._ptrs)
        rc = self._fn(x.data_ptr(), t, self.hidden, self.ffn, gates.ctypes.data, ups.ctypes.data,
                      downs.ctypes.data, e.size, tokens.ctypes.data, wts.ctypes.data,
                      self._qtypes.ctypes.data, 0, out.data_ptr(), self._threads,
                      self._tables.data_ptr(),
                      *extras.args(e.size, self.hidden, self.ffn))  # fmt: skip
        CpuExperts._raise(rc, "moe")
