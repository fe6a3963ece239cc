"""Expert-major MoE for steps of several tokens: an expert's weight tile is read and unpacked
once and multiplied with all of its tokens on the tensor cores (int8 mma).

The row-dot kernels (`kernels.experts.moe`) compute every (token, expert) pair on its own:
eight sequences routed top-8 of 128 give 64 pairs over about 52 distinct experts, 32 give 256
pairs over about 112, and each pair unpacks its expert's codes and multiplies them one `dp4a`
at a time, so a step's arithmetic grows with its pairs while the bytes it must read grow with
its distinct experts. Here a program owns `block_n` output rows of one expert (the first pair
routed to it; the other pairs' programs return at once) and gathers the Q8 rows (`quantize_q8`)
of up to `MEMBERS` of its pairs as the columns of a matrix. Each 32-value sub-block of the
weights is then one integer `tl.dot` ([rows, 32] codes by [32, members] codes, exact in
int32), scaled as the row dots scale it:

- Q4_K (144-byte blocks): `d sc xd sum(q xq) - dmin m xs` per sub-block of 32, the codes the
  low or high nibbles of a pair's 32 bytes;
- Q6_K (210-byte blocks): `d sc (xd sum(q xq) - 32 xs)` per group of 16, so a 32-value chunk
  is two dots, each with the other group's codes zeroed.

The integer dots are exact and each (row, token) is accumulated in a fixed order of its own,
with no sum across tokens: a token's result does not depend on which tokens share its step
or on its place among them. It differs from the row dots' only in the order of the float
sums (they add a step's sub-blocks as a tree); the engine takes one path or the other for
every step alike (`MoeConfig.tensor_cores`, `tensor_core_tokens`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.experts.moe_dots import q6_k_codes
from kernels.experts.pair_groups import group_of, members_chunk
from kernels.formats.byte_loads import _load_f16
from kernels.formats.quant import QType
from kernels.layers.gemv import _k_scale_min

MEMBERS = 16  # pairs of one expert per tile of columns (tl.dot wants 16 at least)
Q4_K: tl.constexpr = tl.constexpr(int(QType.Q4_K))
Q6_K: tl.constexpr = tl.constexpr(int(QType.Q6_K))
# the weight types with a tensor-core reader here
MMA_QTYPES: frozenset[QType] = frozenset({QType.Q4_K, QType.Q6_K})


@triton.jit
def _q4_k_mma(row_at, row_mask, x8_rows, valid, K, BLOCK_N: tl.constexpr, M: tl.constexpr):
    """[BLOCK_N, M] float32: rows of a Q4_K matrix (a row's uint8 address each, `row_at`
    [BLOCK_N]) dot M Q8 rows (their uint8 addresses `x8_rows` [M], `valid` ones read). Pair p
    of a super-block is 32 bytes: low nibbles sub-block 2p, high nibbles 2p + 1."""
    xd_rows = (x8_rows + K).to(tl.pointer_type(tl.float32))
    xs_rows = (x8_rows + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32))
    c32 = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, M], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = row_at + sb * 144  # [BN]
        d = _load_f16(blk, row_mask)[:, None]
        dmin = _load_f16(blk + 2, row_mask)[:, None]
        for p in tl.static_range(4):
            q = tl.load(blk[:, None] + 16 + 32 * p + c32[None, :], mask=row_mask[:, None],
                        other=0)  # fmt: skip  # [BN, 32] uint8
            lo = (q & 0xF).to(tl.int8)
            hi = (q >> 4).to(tl.int8)
            xk = x8_rows[None, :] + (sb * 256 + 64 * p) + c32[:, None]  # [32, M]
            x_lo = tl.load(xk, mask=valid[None, :], other=0).to(tl.int8, bitcast=True)
            x_hi = tl.load(xk + 32, mask=valid[None, :], other=0).to(tl.int8, bitcast=True)
            i_lo = tl.dot(lo, x_lo, out_dtype=tl.int32)  # [BN, M], exact
            i_hi = tl.dot(hi, x_hi, out_dtype=tl.int32)
            sc_lo, m_lo = _k_scale_min(blk + 4, 2 * p, row_mask)
            sc_hi, m_hi = _k_scale_min(blk + 4, 2 * p + 1, row_mask)
            b32 = sb * 8 + 2 * p  # the activation's block of the low nibbles
            xd_lo = tl.load(xd_rows + b32, mask=valid, other=0.0)[None, :]
            xd_hi = tl.load(xd_rows + b32 + 1, mask=valid, other=0.0)[None, :]
            xs_lo = tl.load(xs_rows + 2 * b32, mask=valid, other=0.0)
            xs_lo = (xs_lo + tl.load(xs_rows + 2 * b32 + 1, mask=valid, other=0.0))[None, :]
            xs_hi = tl.load(xs_rows + 2 * b32 + 2, mask=valid, other=0.0)
            xs_hi = (xs_hi + tl.load(xs_rows + 2 * b32 + 3, mask=valid, other=0.0))[None, :]
            lo_scale, lo_min = d * sc_lo[:, None], dmin * m_lo[:, None]
            hi_scale, hi_min = d * sc_hi[:, None], dmin * m_hi[:, None]
            acc += lo_scale * (xd_lo * i_lo.to(tl.float32)) - lo_min * xs_lo
            acc += hi_scale * (xd_hi * i_hi.to(tl.float32)) - hi_min * xs_hi
    return acc


@triton.jit
def _q6_k_mma(row_at, row_mask, x8_rows, valid, K, BLOCK_N: tl.constexpr, M: tl.constexpr):
    """[BLOCK_N, M] float32: rows of a Q6_K matrix dot M Q8 rows (as `_q4_k_mma`). Half n of
    a super-block holds values 128n + 32k + l (k 0..3, l 0..31): low 4 bits in ql[64n + l]
    (+ 32 for odd k; high nibble for k 2, 3), top 2 bits at shift 2k of qh[32n + l], scale
    sc[8n + 2k + l // 16]."""
    xd_rows = (x8_rows + K).to(tl.pointer_type(tl.float32))
    xs_rows = (x8_rows + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32))
    c32 = tl.arange(0, 32)
    first = (c32 < 16)[None, :]  # [1, 32]: group 0 of a 32-value chunk
    acc = tl.zeros([BLOCK_N, M], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = row_at + sb * 210  # [BN]
        d = _load_f16(blk + 208, row_mask)[:, None]
        for n in tl.static_range(2):
            lane = blk[:, None] + c32[None, :]  # [BN, 32]
            qa = tl.load(lane + 64 * n, mask=row_mask[:, None], other=0)
            qb = tl.load(lane + 64 * n + 32, mask=row_mask[:, None], other=0)
            qh = tl.load(lane + 128 + 32 * n, mask=row_mask[:, None], other=0)
            for k in tl.static_range(4):
                q = q6_k_codes(qa, qb, qh, k).to(tl.int8)
                zero = tl.zeros_like(q)
                xk = x8_rows[None, :] + (sb * 256 + 128 * n + 32 * k) + c32[:, None]  # [32, M]
                xq = tl.load(xk, mask=valid[None, :], other=0).to(tl.int8, bitcast=True)
                i0 = tl.dot(tl.where(first, q, zero), xq, out_dtype=tl.int32)  # [BN, M]
                i1 = tl.dot(tl.where(first, zero, q), xq, out_dtype=tl.int32)
                sc_at = blk + 192 + 8 * n + 2 * k
                sc0 = tl.load(sc_at, mask=row_mask, other=0).to(tl.int8, bitcast=True)
                sc1 = tl.load(sc_at + 1, mask=row_mask, other=0).to(tl.int8, bitcast=True)
                xd = tl.load(xd_rows + sb * 8 + 4 * n + k, mask=valid, other=0.0)[None, :]
                g = sb * 16 + 8 * n + 2 * k
                xs0 = tl.load(xs_rows + g, mask=valid, other=0.0)[None, :]
                xs1 = tl.load(xs_rows + g + 1, mask=valid, other=0.0)[None, :]
                part = sc0.to(tl.float32)[:, None] * (xd * i0.to(tl.float32) - 32.0 * xs0)
                part += sc1.to(tl.float32)[:, None] * (xd * i1.to(tl.float32) - 32.0 * xs1)
                acc += d * part
    return acc


@triton.jit
def mma_rows_dot(row_at, row_mask, x8_rows, valid, K, QTYPE: tl.constexpr,
                 BLOCK_N: tl.constexpr, M: tl.constexpr):  # fmt: skip
    """[BLOCK_N, M] float32: rows of a matrix of QTYPE (one of `MMA_QTYPES`) dot M Q8 rows."""
    if QTYPE == Q4_K:
        acc = _q4_k_mma(row_at, row_mask, x8_rows, valid, K, BLOCK_N, M)
    else:
        acc = _q6_k_mma(row_at, row_mask, x8_rows, valid, K, BLOCK_N, M)
    return acc


@triton.jit
def gate_up_mma_kernel(
    ids_ptr,  # [T, k] int: routed experts
    table_ptr,  # [E, 3] int64 byte addresses of this layer's (gate, up, down)
    act_ptr,  # [T * k, F] float32 out
    x8_ptr,  # [T, X8_ROW] uint8: the tokens' Q8 rows
    F,
    H,
    GATE_ROW,  # bytes per row of gate / up
    UP_ROW,
    N_PAIRS,
    X8_ROW,
    TOP_K: tl.constexpr,
    Q_GATE: tl.constexpr,
    Q_UP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr,  # a power of two >= N_PAIRS
    M: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int64)
    first, members = group_of(ids_ptr, s, e, N_PAIRS, PAIRS)
    if (e >= 0) & first:
        gate = tl.load(table_ptr + e * 3).to(tl.pointer_type(tl.uint8))
        up = tl.load(table_ptr + e * 3 + 1).to(tl.pointer_type(tl.uint8))
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < F
        for c0 in range(0, tl.sum(members.to(tl.int32)), M):
            pair, valid = members_chunk(members, c0, PAIRS, M)
            x8_rows = x8_ptr + (pair // TOP_K).to(tl.int64) * X8_ROW
            g = mma_rows_dot(gate + rows.to(tl.int64) * GATE_ROW, rmask, x8_rows, valid, H,
                             Q_GATE, BLOCK_N, M)  # fmt: skip
            u = mma_rows_dot(up + rows.to(tl.int64) * UP_ROW, rmask, x8_rows, valid, H, Q_UP,
                             BLOCK_N, M)  # fmt: skip
            act = g / (1.0 + tl.exp(-g)) * u
            at = act_ptr + pair.to(tl.int64)[None, :] * F + rows[:, None]
            tl.store(at, act, mask=rmask[:, None] & valid[None, :])


@triton.jit
def down_mma_kernel(
    ids_ptr,  # [T, k]
    weights_ptr,  # [T, k] float32 routing weights
    table_ptr,  # [E, 3] int64
    part_ptr,  # [T * k, H] float32 out: each slot's weighted contribution
    act8_ptr,  # [T * k, A8_ROW] uint8: the slots' activations as Q8 rows
    H,
    F,
    DOWN_ROW,
    N_PAIRS,
    A8_ROW,
    Q_DOWN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr,
    M: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    e = tl.load(ids_ptr + s).to(tl.int64)
    if e < 0:  # skipped slots contribute zero
        tl.store(part_ptr + s.to(tl.int64) * H + rows, tl.zeros([BLOCK_N], tl.float32),
                 mask=rmask)  # fmt: skip
    else:
        first, members = group_of(ids_ptr, s, e, N_PAIRS, PAIRS)
        if first:
            down = tl.load(table_ptr + e * 3 + 2).to(tl.pointer_type(tl.uint8))
            for c0 in range(0, tl.sum(members.to(tl.int32)), M):
                pair, valid = members_chunk(members, c0, PAIRS, M)
                a8_rows = act8_ptr + pair.to(tl.int64) * A8_ROW
                y = mma_rows_dot(down + rows.to(tl.int64) * DOWN_ROW, rmask, a8_rows, valid, F,
                                 Q_DOWN, BLOCK_N, M)  # fmt: skip
                w = tl.load(weights_ptr + pair, mask=valid, other=0.0)
                at = part_ptr + pair.to(tl.int64)[None, :] * H + rows[:, None]
                tl.store(at, w[None, :] * y, mask=rmask[:, None] & valid[None, :])
