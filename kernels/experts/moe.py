"""Fused MoE for decode: every routed expert of one layer in one launch per projection.

Each expert's weights are found through a per-(layer, expert) table of byte addresses,
`table[layer, expert] = (gate, up, down)`. An address points either at a VRAM slot or at
host-mapped page-locked RAM: a missed expert is then read in place over PCIe by the kernel
itself, with no host round trip and no copy. The routing ids stay on the device, so a
decode step needs no synchronisation and can be captured in a graph.

Each projection has its own GGUF type (`ExpertFormat`: a Q4_K_M file mixes Q4_K gate/up
with Q6_K or Q5_0 down). Q4_0 is read in a split layout (`split_q4_0`): a GGUF block is 18
bytes, a stride that allows only byte loads, so each matrix keeps its fp16 scales first and
its nibbles after, read as 32-bit words; MXFP4 (17-byte blocks) likewise (`split_mxfp4`: its
codes first, 16 bytes a block, then its exponent bytes); Q6_K may be held split too (`split_q6_k`,
`ExpertFormat.q6_k_split`: its 210-byte blocks leave the words 2-byte aligned), which the
int8 dots alone read. The other types (`MOE_QTYPES`) are read as GGUF blocks
(`kernels.experts.moe_dots`: Q4_K, Q6_K and Q8_0 a block at a time, the rest value by value
through the GEMV kernel's tile decoder). The bytes per expert are those of the GGUF blocks;
gate/up are [F, H], down is [H, F]. Two launches per layer:
  1. `_gate_up_kernel`: act[s] = silu(gate_e @ x_t) * (up_e @ x_t)   for every (token, slot)
  2. `_down_kernel`:    part[s] = weight[s] * (down_e @ act[s]), then out[t] = sum over slots
     (the offload engine sums the parts into the residual stream: `kernels.layers.norm.add_rmsnorm`)
Experts may carry biases (gpt-oss), a row per row of the table the launch reads, read at the
row the table's is (the layer's own [E, ...] for a table of experts; for a step's copy whose
rows are pairs, `pair_biases` gathers them in pair order), and gpt-oss's clamped SwiGLU
(`GluClamp`) in place of silu.
The slots are summed in a fixed order: the result is deterministic.

Several tokens (a decode batch, a short prompt, a drafted window) may share experts. The grid
still has a program per (row block, pair), but for T > 1 the pairs are grouped by expert: the
first pair routed to an expert computes every pair routed to it, one after the other, so the
expert's rows come from memory once and from the SM's cache for the rest; the other programs
of that expert return at once (`_group`). With `MoeConfig.group_pairs` off every pair runs
in its own program, the pairs of an expert in parallel sharing its rows through L2: on the
H100 that was 1.6-3.5% faster for the a3b in Q4_K_M at 1 and 8 sequences, and the sm90 table
ships it off (bench/results/2026-12-06-h100-r17.md). Each pair's arithmetic is that of a lone
token, so a token's output is bit for bit the same in any batch, either way.

Three tiers as everywhere in kernels/: Triton bodies, launchers (`moe_gate_up`, `moe_down`)
that check inputs and build grids, and `fused_moe` (the operation). `fused_moe_ref` is the
torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.experts.moe_dots import blocks_rows_dot
from kernels.experts.moe_dots_q8 import (
    Q8_DOT_QTYPES,
    dequantize_q8_ref,
    dp4a_in_asm,
    q6_k_split_rows_dot,
    q8_rows_dot,
    q8_rows_dot2,
    quantize_q8,
    quantize_q8_ref,
)
from kernels.formats.byte_loads import _load_e8m0_half
from kernels.formats.int_float import _small_to_f32
from kernels.formats.iq_decode import _e2m1_doubled
from kernels.formats.iq_tables import iq_tables
from kernels.formats.quant import QTensor, QType, row_bytes
from kernels.layers.gemv import GEMV_QTYPES

Q4_0_BLOCK, Q4_0_BYTES = 32, 18
Q4_0: tl.constexpr = tl.constexpr(int(QType.Q4_0))
MXFP4: tl.constexpr = tl.constexpr(int(QType.MXFP4))
Q4_K: tl.constexpr = tl.constexpr(int(QType.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(QType.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(QType.Q6_K))
# the types the fused kernels read: Q4_0 and MXFP4 split, the rest as GGUF blocks
MOE_QTYPES: frozenset[QType] = GEMV_QTYPES


@dataclass(frozen=True)
class GluClamp:
    """gpt-oss's clamped SwiGLU in place of silu(gate) * up: the gate clamped from above and
    the up from both sides at `limit`, then gate * sigmoid(alpha * gate) * (up + 1)."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class ExpertFormat:
    """The GGUF type of each projection of an expert as the kernels read it."""

    gate: QType = QType.Q4_0
    up: QType = QType.Q4_0
    down: QType = QType.Q4_0
    # Q6_K projections in the split layout (`split_q6_k`), which only the int8 dots read
    q6_k_split: bool = False

    def __post_init__(self) -> None:
        for name in ("gate", "up", "down"):
            qtype = getattr(self, name)
            if qtype not in MOE_QTYPES:
                raise ValueError(f"the fused MoE kernels do not read {qtype.name} ({name})")

    def check_split(self, config: MoeConfig, aligned: bool) -> None:
        """Raise where a split Q6_K projection would not be read by the int8 dots."""
        for q in (self.gate, self.up, self.down):
            if self.held_split(q) and not self.int8(q, config, aligned):
                raise ValueError("split Q6_K is read by the int8 dots alone (int8_dots, aligned)")

    def held_split(self, qtype: QType) -> bool:
        """Whether projections of `qtype` are held in a split layout of their own settings
        (`KernelConfigs.moe_for`'s `split`): Q6_K with `q6_k_split`."""
        return self.q6_k_split and qtype == QType.Q6_K

    def int8(self, qtype: QType, config: MoeConfig, aligned: bool) -> bool:
        """Whether a projection of `qtype` is dotted in int8 (`MoeConfig.int8_dots`)."""
        return config.int8_dots and aligned and qtype in Q8_DOT_QTYPES

    def aligned(self, hidden: int, ffn: int) -> bool:
        """Whether the Q4_0 projections' nibble words start 16-byte aligned (in a 16-byte
        aligned blob): then the kernels load 16 bytes at a time."""
        shapes = ((self.gate, ffn, hidden), (self.up, ffn, hidden), (self.down, hidden, ffn))
        return all(q != QType.Q4_0 or split_q4_0_ok(r, c) for q, r, c in shapes)


@dataclass(frozen=True)
class MoeConfig:
    """Launch settings (tuning tables override them per device)."""

    block_n: int = 16  # output rows per program
    # Q4_0 blocks (of 32 columns) per reduction step: 32 keeps more loads in flight (the
    # H200's graph-timed tuning at a3b's shapes: 25.9 against 28.7 us with 8)
    block_b: int = 32
    block_k: int = 256  # columns per reduction step of the value-by-value GGUF-block types
    # K-quant super-blocks (256 columns) per reduction step of the Q4_K/Q5_K/Q6_K readers:
    # every load of a step is in flight at once (a power of two)
    super_blocks: int = 1
    # Q4_K, Q5_K, Q6_K and Q8_0 dotted in int8 (`kernels.experts.moe_dots_q8`: the activation
    # quantized to 8 bits per 32 values once, four codes per dp4a) where the blobs are aligned;
    # else in float32
    int8_dots: bool = False
    # T > 1: the pairs routed to one expert are computed by one program, one after the other,
    # its rows read from memory once (`_group`); off: a program per pair as for one token,
    # the pairs of an expert in parallel, its rows shared through the L2 cache
    group_pairs: bool = True
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.super_blocks < 1 or self.super_blocks & (self.super_blocks - 1):
            raise ValueError(f"super_blocks must be a power of two, got {self.super_blocks}")


# --- Triton ------------------------------------------------------------------------------


@triton.jit
def _nibble_rows_dot(
    w_ptr,
    rows,
    row_mask,
    x_ptr,
    K,
    N,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ALIGNED: tl.constexpr,
    MX: tl.constexpr,
):
    """[BLOCK_N] float32: rows `rows` of a split matrix [N, K] at byte address w_ptr, dot
    x [K]: Q4_0 (`split_q4_0`: every block's fp16 scale, then its nibbles, d (q - 8)) or, with
    MX, MXFP4 (`split_mxfp4`: every block's codes, then its exponent byte, 2^(e - 128) times the
    doubled E2M1 level, computed from the code's bits). A block's 16 nibble bytes are read as
    four 32-bit words; ALIGNED: they start on 16 bytes, so a block's words are one 16-byte
    load. Each block's scale is applied once to its dot."""
    nb = K // 32
    if MX:
        words = w_ptr.to(tl.pointer_type(tl.int32))
        scales = w_ptr + N * nb * 16
    else:
        words = (w_ptr + N * nb * 2).to(tl.pointer_type(tl.int32))
        scales = w_ptr.to(tl.pointer_type(tl.float16))
    if ALIGNED:
        words = tl.multiple_of(words, 16)
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    ww = tl.arange(0, 4)  # word within a block: bytes 4w..4w+3
    for b0 in range(0, nb, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)  # [BB]
        bmask = row_mask[:, None] & (blk[None, :] < nb)  # [BN, BB]
        at = rows64[:, None] * nb + blk[None, :]
        if MX:
            d = _load_e8m0_half(scales + at, bmask)
        else:
            d = tl.load(scales + at, mask=bmask, other=0.0).to(tl.float32)
        wptr = words + rows64[:, None, None] * (nb * 4) + blk[None, :, None] * 4 + ww[None, None, :]
        q = tl.load(wptr, mask=bmask[:, :, None], other=0)  # [BN, BB, 4] int32
        xb = x_ptr + blk[:, None] * 32 + ww[None, :] * 4  # [BB, 4]: value 4w (+i, +16)
        xmask = blk[:, None] < nb
        part = tl.zeros([BLOCK_N, BLOCK_B, 4], dtype=tl.float32)
        for i in tl.static_range(4):  # byte i of each word: values 4w+i (low), 4w+i+16 (high)
            x_lo = tl.load(xb + i, mask=xmask, other=0.0).to(tl.float32)
            x_hi = tl.load(xb + 16 + i, mask=xmask, other=0.0).to(tl.float32)
            lo = (q >> (8 * i)) & 0xF
            hi = (q >> (8 * i + 4)) & 0xF
            if MX:
                lo, hi = _e2m1_doubled(lo), _e2m1_doubled(hi)
            else:  # q - 8 with no conversion instruction (`kernels.formats.int_float`)
                lo, hi = _small_to_f32(lo, 8), _small_to_f32(hi, 8)
            part += lo * x_lo[None, :, :] + hi * x_hi[None, :, :]
        acc += tl.sum(tl.sum(part, axis=2) * d, axis=1)
    return acc


@triton.jit
def _rows_dot(
    w_ptr,
    rows,
    row_mask,
    x_ptr,
    K,
    N,
    ROW_BYTES,
    tab_ptr,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr,
    SBS: tl.constexpr,
    x8_ptr,
    X8: tl.constexpr,
    ASM: tl.constexpr,
    Q6_SPLIT: tl.constexpr,
):
    """Rows of a projection of type QTYPE (Q4_0 and MXFP4: their split layouts; Q6_K with
    Q6_SPLIT too)
    dot x [K] (X8: dot x's Q8 row at x8_ptr in int8, `kernels.experts.moe_dots_q8`)."""
    if X8 and Q6_SPLIT and QTYPE == Q6_K:
        acc = q6_k_split_rows_dot(w_ptr, rows, row_mask, x8_ptr, K, N, BLOCK_N, SBS, ASM)
    elif X8:
        row_at = w_ptr + rows.to(tl.int64) * ROW_BYTES
        acc = q8_rows_dot(row_at, row_mask, x8_ptr, K, QTYPE, BLOCK_N, SBS, ASM)
    elif QTYPE == Q4_0 or QTYPE == MXFP4:  # noqa: SIM109
        acc = _nibble_rows_dot(w_ptr, rows, row_mask, x_ptr, K, N, BLOCK_N, BLOCK_B, ALIGNED,
                               QTYPE == MXFP4)  # fmt: skip
    else:
        acc = blocks_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, QTYPE,
                              BLOCK_N, BLOCK_K, ALIGNED, SBS)  # fmt: skip
    return acc


@triton.jit
def _matrix_at(table_ptr, e, j, ALIGNED16: tl.constexpr):
    """The byte address of projection j (0 gate, 1 up, 2 down) of expert e. ALIGNED16: the
    caller vouches that it is 16-byte aligned (the int8 dots are taken only then), and the
    compiler, told so, loads the rows' words 16 bytes at a time."""
    at = tl.load(table_ptr + e * 3 + j).to(tl.pointer_type(tl.uint8))
    if ALIGNED16:
        at = tl.multiple_of(at, 16)
    return at


@triton.jit
def _group(ids_ptr, s, e, N_PAIRS, PAIRS: tl.constexpr):
    """Pairs routed to expert `e`, for program `s`: (whether s is the first of them, the
    pairs [PAIRS] as a mask over 0..PAIRS-1). Grouping lets one program read an expert's rows
    once for every token routed to it; the other programs of that expert do nothing."""
    at = tl.arange(0, PAIRS)
    every = tl.load(ids_ptr + at, mask=at < N_PAIRS, other=-1)
    members = (every == e) & (at < N_PAIRS)
    first = tl.min(tl.where(members, at, PAIRS)) == s
    return first, members


@triton.jit
def _next_member(members, j, PAIRS: tl.constexpr):
    """The next pair after j of an expert's group (PAIRS: none)."""
    at = tl.arange(0, PAIRS)
    return tl.min(tl.where(members & (at > j), at, PAIRS))


@triton.jit
def _gate_up_pair(x_ptr, act_ptr, gate, up, s, e, t, rows, rmask, H, F, GATE_ROW, UP_ROW, tab_ptr,
                  Q_GATE: tl.constexpr, Q_UP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr,
                  SBS: tl.constexpr, x8_ptr, X8_ROW, X8_GATE: tl.constexpr,
                  X8_UP: tl.constexpr, ASM: tl.constexpr, Q6_SPLIT: tl.constexpr, bias_ptr,
                  BIAS: tl.constexpr, CLAMP: tl.constexpr, alpha, limit):  # fmt: skip
    """act[s] = silu(gate @ x[t]) * (up @ x[t]) on `rows` (BIAS: the gate and up biases of
    table row e, pair s's, added first; CLAMP: gpt-oss's clamped SwiGLU, `GluClamp`)."""
    x = x_ptr + t.to(tl.int64) * H
    x8 = x8_ptr + t.to(tl.int64) * X8_ROW
    if X8_GATE and X8_UP and Q_GATE == Q_UP and (Q_GATE == Q4_K or Q_GATE == Q5_K):  # noqa: SIM109
        # one pass over x's Q8 row for both (constexprs: Triton compiles the test away)
        at = rows.to(tl.int64) * GATE_ROW
        g, u = q8_rows_dot2(gate + at, up + at, rmask, x8, H, Q_GATE, BLOCK_N, SBS, ASM)
    else:
        g = _rows_dot(gate, rows, rmask, x, H, F, GATE_ROW, tab_ptr, Q_GATE, BLOCK_N, BLOCK_B,
                      BLOCK_K, ALIGNED, SBS, x8, X8_GATE, ASM, Q6_SPLIT)  # fmt: skip
        u = _rows_dot(up, rows, rmask, x, H, F, UP_ROW, tab_ptr, Q_UP, BLOCK_N, BLOCK_B,
                      BLOCK_K, ALIGNED, SBS, x8, X8_UP, ASM, Q6_SPLIT)  # fmt: skip
    if BIAS:  # [table rows, 2, F]: row e's gate biases, then its up biases
        at = bias_ptr + e * 2 * F + rows
        g += tl.load(at, mask=rmask, other=0.0)
        u += tl.load(at + F, mask=rmask, other=0.0)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        act = g / (1.0 + tl.exp(-alpha * g)) * u
    else:
        act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + s.to(tl.int64) * F + rows, act, mask=rmask)


@triton.jit
def _down_pair(act_ptr, weights_ptr, part_ptr, down, s, e, rows, rmask, H, F, DOWN_ROW, tab_ptr,
               Q_DOWN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
               BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr, SBS: tl.constexpr, act8_ptr,
               A8_ROW, X8_DOWN: tl.constexpr, ASM: tl.constexpr,
               Q6_SPLIT: tl.constexpr, bias_ptr, BIAS: tl.constexpr):  # fmt: skip
    """part[s] = weight[s] * (down @ act[s] (+ table row e's down bias: BIAS)) on `rows`."""
    w = tl.load(weights_ptr + s)
    act = act_ptr + s.to(tl.int64) * F
    act8 = act8_ptr + s.to(tl.int64) * A8_ROW
    y = _rows_dot(down, rows, rmask, act, F, H, DOWN_ROW, tab_ptr, Q_DOWN, BLOCK_N, BLOCK_B,
                  BLOCK_K, ALIGNED, SBS, act8, X8_DOWN, ASM, Q6_SPLIT)  # fmt: skip
    if BIAS:  # [table rows, H]
        y += tl.load(bias_ptr + e * H + rows, mask=rmask, other=0.0)
    y = w * y
    tl.store(part_ptr + s.to(tl.int64) * H + rows, y, mask=rmask)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] activations (normed hidden states)
    ids_ptr,  # [T, k] int: routed experts
    table_ptr,  # [E, 3] int64 byte addresses of this layer's (gate, up, down)
    act_ptr,  # [T * k, F] float32 out
    H,
    F,
    GATE_ROW,  # bytes per row of gate / up (GGUF-block types)
    UP_ROW,
    tab_ptr,  # the i-quants' tables (kernels.formats.iq_tables)
    N_PAIRS,  # T * k
    x8_ptr,  # [T, X8_ROW] uint8: x's Q8 rows (X8_GATE or X8_UP); else unread
    X8_ROW,
    TOP_K: tl.constexpr,
    Q_GATE: tl.constexpr,
    Q_UP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr,
    SBS: tl.constexpr,  # K-quant super-blocks per step
    PAIRS: tl.constexpr,  # 0: one program per pair; else a power of two >= N_PAIRS (grouped)
    X8_GATE: tl.constexpr,  # gate / up dotted with x's Q8 rows
    X8_UP: tl.constexpr,
    ASM: tl.constexpr,  # dp4a as inline PTX (else its emulation)
    Q6_SPLIT: tl.constexpr,  # Q6_K projections in the split layout (split_q6_k)
    bias_ptr,  # [table rows, 2, F] float32: each row's gate and up biases (BIAS); else unread
    BIAS: tl.constexpr,
    CLAMP: tl.constexpr,  # gpt-oss's clamped SwiGLU (GluClamp: alpha, limit)
    alpha,
    limit,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)  # (token, slot) pair
    e = tl.load(ids_ptr + s).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < F
    if PAIRS == 0:
        if e >= 0:  # a negative id: this slot is computed elsewhere (the CPU miss path)
            gate = _matrix_at(table_ptr, e, 0, X8_GATE | X8_UP)
            up = _matrix_at(table_ptr, e, 1, X8_GATE | X8_UP)
            _gate_up_pair(x_ptr, act_ptr, gate, up, s, e, s // TOP_K, rows, rmask, H, F, GATE_ROW,
                          UP_ROW, tab_ptr, Q_GATE, Q_UP, BLOCK_N, BLOCK_B, BLOCK_K,
                          ALIGNED, SBS, x8_ptr, X8_ROW, X8_GATE, X8_UP, ASM,
                          Q6_SPLIT, bias_ptr, BIAS, CLAMP, alpha, limit)  # fmt: skip
    else:
        first, members = _group(ids_ptr, s, e, N_PAIRS, PAIRS)
        if (e >= 0) & first:
            gate = _matrix_at(table_ptr, e, 0, X8_GATE | X8_UP)
            up = _matrix_at(table_ptr, e, 1, X8_GATE | X8_UP)
            j = s
            for _ in range(tl.sum(members.to(tl.int32))):  # the expert's rows stay in cache
                _gate_up_pair(x_ptr, act_ptr, gate, up, j, e, j // TOP_K, rows, rmask, H, F,
                              GATE_ROW, UP_ROW, tab_ptr, Q_GATE, Q_UP, BLOCK_N, BLOCK_B,
                              BLOCK_K, ALIGNED, SBS, x8_ptr, X8_ROW, X8_GATE, X8_UP,
                              ASM, Q6_SPLIT, bias_ptr, BIAS, CLAMP, alpha, limit)  # fmt: skip
                j = _next_member(members, j, PAIRS)


@triton.jit
def _down_kernel(
    act_ptr,  # [T * k, F] float32
    ids_ptr,  # [T, k]
    weights_ptr,  # [T, k] float32 routing weights
    table_ptr,  # [E, 3] int64
    part_ptr,  # [T * k, H] float32 out: each slot's weighted contribution
    H,
    F,
    DOWN_ROW,
    tab_ptr,
    N_PAIRS,
    act8_ptr,  # [T * k, A8_ROW] uint8: act's Q8 rows (X8_DOWN); else unread
    A8_ROW,
    Q_DOWN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr,
    SBS: tl.constexpr,
    PAIRS: tl.constexpr,  # as in _gate_up_kernel
    X8_DOWN: tl.constexpr,
    ASM: tl.constexpr,
    Q6_SPLIT: tl.constexpr,
    bias_ptr,  # [table rows, H] float32: each row's down bias (BIAS); else unread
    BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)  # (token, slot) pair: one program per slot keeps the grid wide
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    e = tl.load(ids_ptr + s).to(tl.int64)
    if e < 0:  # skipped slots contribute zero
        tl.store(part_ptr + s.to(tl.int64) * H + rows, tl.zeros([BLOCK_N], tl.float32),
                 mask=rmask)  # fmt: skip
    elif PAIRS == 0:
        down = _matrix_at(table_ptr, e, 2, X8_DOWN)
        _down_pair(act_ptr, weights_ptr, part_ptr, down, s, e, rows, rmask, H, F, DOWN_ROW,
                   tab_ptr, Q_DOWN, BLOCK_N, BLOCK_B, BLOCK_K, ALIGNED, SBS, act8_ptr, A8_ROW,
                   X8_DOWN, ASM, Q6_SPLIT, bias_ptr, BIAS)  # fmt: skip
    else:
        first, members = _group(ids_ptr, s, e, N_PAIRS, PAIRS)
        if first:
            down = _matrix_at(table_ptr, e, 2, X8_DOWN)
            j = s
            for _ in range(tl.sum(members.to(tl.int32))):
                _down_pair(act_ptr, weights_ptr, part_ptr, down, j, e, rows, rmask, H, F,
                           DOWN_ROW, tab_ptr, Q_DOWN, BLOCK_N, BLOCK_B, BLOCK_K,
                           ALIGNED, SBS, act8_ptr, A8_ROW, X8_DOWN, ASM, Q6_SPLIT,
                           bias_ptr, BIAS)  # fmt: skip
                j = _next_member(members, j, PAIRS)


# --- launchers ---------------------------------------------------------------------------


def _grouped(tokens: int, pairs: int, config: MoeConfig) -> int:
    """The kernels' PAIRS: 0 for one token (its k experts are distinct: a program per pair)
    or without `config.group_pairs`, else the power of two the grouping scans (several tokens
    may share an expert)."""
    return 0 if tokens == 1 or not config.group_pairs else triton.next_power_of_2(pairs)


def _check(x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [T, H], got {tuple(x.shape)}")
    if ids.shape[0] != x.shape[0] or ids.dim() != 2 or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [T, k], got {tuple(ids.shape)}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"table must be int64 [E, 3], got {table.dtype} {tuple(table.shape)}")
    if not (x.device == ids.device == table.device):
        raise ValueError("x, ids and table must be on one device")


def _check_bias(bias: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    if bias is None:
        return
    if bias.dtype != torch.float32 or bias.shape != shape or not bias.is_contiguous():
        raise ValueError(f"expert biases must be contiguous float32 {list(shape)}, got"
                         f" {bias.dtype} {tuple(bias.shape)}")  # fmt: skip
    if bias.device != device:
        raise ValueError(f"expert biases are on {bias.device}, the activations on {device}")


def pair_biases(
    biases: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (token, slot) pair's expert's biases in pair order, [T * k, 2, F] and [T * k, H],
    from each expert's (gate and up [E, 2, F], down [E, H]) and the routed ids [T, k] (a
    negative id, a skipped slot, reads expert 0's: unused): the biases of a step's table
    whose rows are pairs (`kernels.experts.expert_fetch`)."""
    at = ids.reshape(-1).clamp(min=0).long()
    return biases[0].index_select(0, at), biases[1].index_select(0, at)


def moe_gate_up(
    x: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    ffn: int,
    config: MoeConfig = MoeConfig(),
    aligned: bool = False,
    fmt: ExpertFormat = ExpertFormat(),
    bias: torch.Tensor | None = None,
    clamp: GluClamp | None = None,
) -> torch.Tensor:
    """x [T, H], ids [T, k], table [E, 3] -> act [T * k, F] float32. `aligned`: the caller
    vouches that every address in `table` is 16-byte aligned (see `fused_moe`); `fmt`: the
    projections' types; `bias` [E, 2, F] float32: the gate and up biases of each row of
    `table` (a step's copy whose rows are pairs: `pair_biases`);
    `clamp`: gpt-oss's clamped SwiGLU in place of silu(gate) * up."""
    _check(x, ids, table)
    _check_bias(bias, (table.shape[0], 2, ffn), x.device)
    fmt.check_split(config, aligned)
    t, h = x.shape
    # raises for a row length the types' blocks do not divide
    gate_row, up_row = row_bytes(fmt.gate, h), row_bytes(fmt.up, h)
    pairs = t * ids.shape[1]
    act = torch.empty(pairs, ffn, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(ffn, config.block_n), pairs)
    x8_gate, x8_up = fmt.int8(fmt.gate, config, aligned), fmt.int8(fmt.up, config, aligned)
    x8 = quantize_q8(x) if x8_gate or x8_up else x
    _gate_up_kernel[grid](
        x, ids, table, act, h, ffn, gate_row, up_row, iq_tables(x.device), pairs, x8,
        x8.shape[1] if x8 is not x else 0,
        TOP_K=ids.shape[1], Q_GATE=int(fmt.gate), Q_UP=int(fmt.up), BLOCK_N=config.block_n,
        BLOCK_B=config.block_b, BLOCK_K=config.block_k,
        ALIGNED=aligned and fmt.aligned(h, ffn), SBS=config.super_blocks,
        PAIRS=_grouped(t, pairs, config), X8_GATE=x8_gate, X8_UP=x8_up, ASM=dp4a_in_asm(x.device),
        Q6_SPLIT=fmt.q6_k_split, bias_ptr=bias if bias is not None else x,
        BIAS=bias is not None, CLAMP=clamp is not None, alpha=clamp.alpha if clamp else 1.0,
        limit=clamp.limit if clamp else 0.0, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return act


def moe_down(
    act: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    table: torch.Tensor,
    hidden: int,
    config: MoeConfig = MoeConfig(),
    aligned: bool = False,
    fmt: ExpertFormat = ExpertFormat(),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """act [T * k, F], ids/weights [T, k], table [E, 3] -> parts [T, k, H] float32: each
    (token, slot)'s weighted contribution (no atomics: the caller sums the slots in a fixed
    order, so the result does not depend on scheduling). `bias` [E, H] float32: the down
    bias of each row of `table`, added before the weight (gpt-oss)."""
    t, k = ids.shape
    if act.shape[0] != t * k or weights.shape != ids.shape or weights.dtype != torch.float32:
        raise ValueError("act must be [T * k, F] and weights float32 [T, k]")
    _check_bias(bias, (table.shape[0], hidden), act.device)
    part = torch.empty(t * k, hidden, dtype=torch.float32, device=act.device)
    grid = (triton.cdiv(hidden, config.block_n), t * k)
    ffn = act.shape[1]
    fmt.check_split(config, aligned)
    x8_down = fmt.int8(fmt.down, config, aligned)
    act8 = quantize_q8(act) if x8_down else act
    _down_kernel[grid](
        act, ids, weights.contiguous(), table, part, hidden, ffn, row_bytes(fmt.down, ffn),
        iq_tables(act.device), t * k, act8, act8.shape[1] if x8_down else 0,
        Q_DOWN=int(fmt.down), BLOCK_N=config.block_n, BLOCK_B=config.block_b,
        BLOCK_K=config.block_k, ALIGNED=aligned and fmt.aligned(hidden, ffn),
        SBS=config.super_blocks, PAIRS=_grouped(t, t * k, config), X8_DOWN=x8_down,
        ASM=dp4a_in_asm(act.device), Q6_SPLIT=fmt.q6_k_split,
        bias_ptr=bias if bias is not None else act, BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return part.view(t, k, hidden)


def fused_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    table: torch.Tensor,
    ffn: int,
    config: MoeConfig = MoeConfig(),
    aligned: bool = False,
    fmt: ExpertFormat = ExpertFormat(),
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    clamp: GluClamp | None = None,
) -> torch.Tensor:
    """The routed-expert output [T, H] of one layer, experts found through `table`. Slots
    whose id is negative are skipped (they contribute zero: computed elsewhere). `aligned`:
    the caller vouches that every address in `table` is 16-byte aligned; where the shapes
    keep the nibbles aligned too (`split_q4_0_ok`), the kernels then load 16 bytes at a time.
    `fmt`: each projection's type; `biases`: each expert's (gate and up [E, 2, F], down
    [E, H]) float32; `clamp`: the clamped SwiGLU."""
    gate_up_bias, down_bias = biases if biases is not None else (None, None)
    act = moe_gate_up(x, ids, table, ffn, config, aligned, fmt, gate_up_bias, clamp)
    parts = moe_down(act, ids, weights, table, x.shape[1], config, aligned, fmt, down_bias)
    return parts.sum(1).to(x.dtype)


# --- reference ---------------------------------------------------------------------------


def split_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks [N, K/32 * 18] -> the kernels' layout, flat bytes of the same size:
    every block's fp16 scale [N, K/32], then every block's 16 nibble bytes [N, K/32, 16]."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q4_0_BYTES)
    return torch.cat([b[:, :, :2].reshape(-1), b[:, :, 2:].reshape(-1)])


def unsplit_q4_0(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `split_q4_0`: data [..., bytes] (one split matrix per leading index) ->
    Q4_0 blocks [..., rows, cols/32 * 18]."""
    lead, nb = data.shape[:-1], cols // Q4_0_BLOCK
    scales = data[..., : rows * nb * 2].reshape(*lead, rows, nb, 2)
    nibbles = data[..., rows * nb * 2 :].reshape(*lead, rows, nb, 16)
    return torch.cat([scales, nibbles], dim=-1).reshape(*lead, rows, nb * Q4_0_BYTES)


MXFP4_BYTES = 17  # a block of 32: its E8M0 exponent, then 16 bytes of codes


def split_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [N, K/32 * 17] -> the kernels' layout, flat bytes of the same size: every
    block's 16 code bytes [N, K/32, 16] (on 16 bytes where the matrix is), then every block's
    exponent byte [N, K/32]."""
    b = blocks.reshape(blocks.shape[0], -1, MXFP4_BYTES)
    return torch.cat([b[:, :, 1:].reshape(-1), b[:, :, 0].reshape(-1)])


def split_mxfp4_ok(rows: int, cols: int) -> bool:
    """Whether a [rows, cols] MXFP4 matrix is whole 16-byte words (17 bytes a block): then
    the matrices after it in a blob start on 16 bytes as it does, so every code word the
    kernels load is aligned."""
    return cols % 32 == 0 and (rows * (cols // 32)) % 16 == 0


def unsplit_mxfp4(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `split_mxfp4`: data [..., bytes] (one split matrix per leading index) ->
    MXFP4 blocks [..., rows, cols/32 * 17]."""
    lead, nb = data.shape[:-1], cols // 32
    codes = data[..., : rows * nb * 16].reshape(*lead, rows, nb, 16)
    exps = data[..., rows * nb * 16 : rows * nb * MXFP4_BYTES].reshape(*lead, rows, nb, 1)
    return torch.cat([exps, codes], dim=-1).reshape(*lead, rows, nb * MXFP4_BYTES)


Q6_K_BLOCK_BYTES, Q6_K_BODY_BYTES = 210, 208  # a block; its ql, qh and scales


def split_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [N, K/256 * 210] -> the split layout, flat bytes of the same size: every
    block's first 208 bytes (ql 128, qh 64, scales 16) [N, K/256, 208], then every block's
    fp16 d [N, K/256, 2]. A GGUF block is 210 bytes, a stride that keeps its words 2-byte
    aligned; split, every block's codes and scales start on 16 bytes where the matrix does."""
    b = blocks.reshape(blocks.shape[0], -1, Q6_K_BLOCK_BYTES)
    return torch.cat([b[:, :, :Q6_K_BODY_BYTES].reshape(-1), b[:, :, Q6_K_BODY_BYTES:].reshape(-1)])


def unsplit_q6_k(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `split_q6_k`: data [..., bytes] (one split matrix per leading index) ->
    Q6_K blocks [..., rows, cols/256 * 210]."""
    lead, n = data.shape[:-1], rows * (cols // 256)
    body = data[..., : n * Q6_K_BODY_BYTES].reshape(*lead, n, Q6_K_BODY_BYTES)
    d = data[..., n * Q6_K_BODY_BYTES : n * Q6_K_BLOCK_BYTES].reshape(*lead, n, 2)
    return torch.cat([body, d], dim=-1).reshape(*lead, rows, -1)


def split_q4_0_ok(rows: int, cols: int) -> bool:
    """Whether the nibble words of a [rows, cols] matrix start 16-byte aligned."""
    return cols % Q4_0_BLOCK == 0 and (rows * (cols // Q4_0_BLOCK) * 2) % 16 == 0


def expert_table(experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[E, 3] int64 addresses of (gate, up, down) split-Q4_0 matrices, one triple per expert."""
    return torch.tensor(
        [[g.data_ptr(), u.data_ptr(), d.data_ptr()] for g, u, d in experts], dtype=torch.int64
    )


def fused_moe_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[tuple[QTensor, QTensor, QTensor]],
    int8: tuple[bool, bool, bool] = (False, False, False),
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    clamp: GluClamp | None = None,
) -> torch.Tensor:
    """Dequantize each routed expert (standard GGUF blocks) and compute in float32; `int8`:
    which of gate, up, down take their input as its Q8 row stands for it (`kernels
    .moe_dots_q8`, as the kernels' int8 dots do); `biases` and `clamp` as `fused_moe`'s."""

    def q8(v: torch.Tensor, on: bool) -> torch.Tensor:
        return dequantize_q8_ref(quantize_q8_ref(v[None]), v.numel())[0] if on else v

    out = torch.zeros(x.shape, dtype=torch.float32)
    xf = x.float().cpu()
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate, up, down = (w.dequantize() for w in experts[e])
            g, u = gate @ q8(xf[t], int8[0]), up @ q8(xf[t], int8[1])
            if biases is not None:
                g, u = g + biases[0][e, 0].cpu(), u + biases[0][e, 1].cpu()
            if clamp is None:
                h = torch.nn.functional.silu(g) * u
            else:
                g = g.clamp(max=clamp.limit)
                h = g * torch.sigmoid(clamp.alpha * g) * (u.clamp(-clamp.limit, clamp.limit) + 1)
            y = down @ q8(h, int8[2])
            if biases is not None:
                y = y + biases[1][e].cpu()
            out[t] += float(weights[t, s]) * y
    return out.to(x.dtype)
