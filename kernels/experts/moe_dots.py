"""Row dots of the fused MoE kernels for the GGUF types kept as blocks (`kernels.experts.moe` keeps
Q4_0 and MXFP4 in their split layouts and dots them there).

Each takes rows of one projection at byte address `w_ptr` (ROW_BYTES per row) and an
activation x [K], and returns [BLOCK_N] float32. Decoding value by value (the GEMV kernel's
tile decoder) costs several byte loads per weight; the common types get a block-shaped tile
instead, so each load serves several values and each (sub-)block's scale is applied once to
its dot:
- Q4_K and Q5_K (where the blobs are aligned): the 128 bytes of nibbles (and Q5_K's plane
  of 5th bits) as 32-bit words, `super_blocks` super-blocks per step.
- Q6_K: a super-block as [half, 16-value group pair, 16], 3 byte loads per 4 weights,
  `super_blocks` super-blocks per step.
- Q8_0: blocks of 32 int8 with one scale each.
- Q2_K (aligned: codes as words) and Q3_K (one code byte per 4 weights, one high-bit byte
  per 8): each 16-value sub-block's scale once.
- the i-quants IQ4_XS (aligned), IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S and IQ1_S: their
  block shapes in `kernels.experts.moe_dots_iq`.
Every other type (Q4_1, Q5_0, Q5_1, IQ4_NL, and the unaligned blobs of the word readers):
`_values_rows_dot`, value by value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.experts.moe_dots_iq import _grid_rows_dot, _iq3_s_rows_dot, _iq4_xs_rows_dot
from kernels.formats.byte_loads import _load_f16
from kernels.formats.iq_decode import GRID_BITS
from kernels.formats.quant import QType
from kernels.layers.gemv import _dequant_tile, _k_scale_min

Q2_K: tl.constexpr = tl.constexpr(int(QType.Q2_K))
Q3_K: tl.constexpr = tl.constexpr(int(QType.Q3_K))
Q4_K: tl.constexpr = tl.constexpr(int(QType.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(QType.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(QType.Q6_K))
Q8_0: tl.constexpr = tl.constexpr(int(QType.Q8_0))
IQ4_XS: tl.constexpr = tl.constexpr(int(QType.IQ4_XS))
IQ3_S: tl.constexpr = tl.constexpr(int(QType.IQ3_S))


@triton.jit
def _values_rows_dot(
    w_ptr,
    rows,
    row_mask,
    x_ptr,
    K,
    ROW_BYTES,
    tab_ptr,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_N] float32: rows `rows` of a matrix of GGUF blocks (ROW_BYTES per row) at byte
    address w_ptr, dot x [K]."""
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * ROW_BYTES  # [BN, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        w = _dequant_tile(row_ptr, ks, row_mask[:, None] & (ks < K), tab_ptr, QTYPE)  # [BN, BK]
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)  # [1, BK]
        acc += tl.sum(w * x, axis=1)
    return acc


@triton.jit
def _q45_k_rows_dot(
    w_ptr,
    rows,
    row_mask,
    x_ptr,
    K,
    ROW_BYTES,
    BLOCK_N: tl.constexpr,
    FIVE_BIT: tl.constexpr,
    SBS: tl.constexpr,
):
    """[BLOCK_N] float32: rows of a Q4_K (144-byte) or Q5_K (176: a 32-byte plane of 5th bits
    before the nibbles) matrix at byte address w_ptr (rows and blocks 16-byte aligned) dot
    x [K], SBS super-blocks (256 values each) per step: a decode GEMV is bound by the loads in
    flight, so a step issues every load of SBS super-blocks at once. A super-block's 128 bytes
    of nibbles are read as 32-bit words [pair, word]: byte b of word w of pair p holds value
    64p + 4w + b (low nibble, sub-block 2p) and 64p + 32 + 4w + b (high nibble, sub-block
    2p + 1); Q5_K's 5th bit of sub-block s, value j, is bit s of byte j of the plane. The tile
    is [BN, (super-block, pair), word]. Each sub-block's dot is scaled once:
    d * sc * sum(q x) - dmin * m * sum(x)."""
    rows64 = rows.to(tl.int64)[:, None, None]  # [BN, 1, 1]
    sp = tl.arange(0, 4 * SBS)[None, :, None]  # [1, P, 1]: (super-block of the step, pair)
    word = tl.arange(0, 8)[None, None, :]  # [1, 1, 8]
    sp2 = tl.arange(0, 4 * SBS)[None, :]  # [1, P]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    nbytes = 144 + 32 * FIVE_BIT  # the block's bytes
    nsb = K // 256
    for sb0 in range(0, nsb, SBS):
        sb, pair = sb0 + sp // 4, sp % 4
        smask = sb < nsb  # [1, P, 1]
        mask3 = row_mask[:, None, None] & smask
        blk = w_ptr + rows64 * ROW_BYTES + sb * nbytes  # [BN, P, 1]
        qs = blk + nbytes - 128
        q = tl.load((qs + pair * 32 + word * 4).to(tl.pointer_type(tl.int32)), mask=mask3,
                    other=0)  # fmt: skip
        if FIVE_BIT:
            qh = tl.load((blk + 16 + word * 4).to(tl.pointer_type(tl.int32)), mask=mask3,
                         other=0)  # fmt: skip  # [BN, P, 8]
        xb = x_ptr + sb * 256 + pair * 64 + word * 4  # [1, P, 8]
        dot_lo = tl.zeros([BLOCK_N, 4 * SBS, 8], dtype=tl.float32)
        dot_hi = tl.zeros([BLOCK_N, 4 * SBS, 8], dtype=tl.float32)
        sum_lo = tl.zeros([1, 4 * SBS, 8], dtype=tl.float32)
        sum_hi = tl.zeros([1, 4 * SBS, 8], dtype=tl.float32)
        for b in tl.static_range(4):
            x_lo = tl.load(xb + b, mask=smask, other=0.0).to(tl.float32)
            x_hi = tl.load(xb + 32 + b, mask=smask, other=0.0).to(tl.float32)
            lo = (q >> (8 * b)) & 0xF
            hi = (q >> (8 * b + 4)) & 0xF
            if FIVE_BIT:
                lo = lo | (((qh >> (8 * b + 2 * pair)) & 1) << 4)
                hi = hi | (((qh >> (8 * b + 2 * pair + 1)) & 1) << 4)
            dot_lo += lo.to(tl.float32) * x_lo
            dot_hi += hi.to(tl.float32) * x_hi
            sum_lo += x_lo
            sum_hi += x_hi
        sb2, pair2 = sb0 + sp2 // 4, sp2 % 4
        hmask = row_mask[:, None] & (sb2 < nsb)  # [BN, P]
        head = w_ptr + rows.to(tl.int64)[:, None] * ROW_BYTES + sb2 * nbytes  # [BN, P]
        d = _load_f16(head, hmask)
        dmin = _load_f16(head + 2, hmask)
        sub = 2 * pair2  # the low nibbles' sub-blocks
        sc_lo, m_lo = _k_scale_min(head + 4, sub, hmask)  # [BN, P]
        sc_hi, m_hi = _k_scale_min(head + 4, sub + 1, hmask)
        part = (d * sc_lo) * tl.sum(dot_lo, axis=2) - (dmin * m_lo) * tl.sum(sum_lo, axis=2)
        part += (d * sc_hi) * tl.sum(dot_hi, axis=2) - (dmin * m_hi) * tl.sum(sum_hi, axis=2)
        acc += tl.sum(part, axis=1)
    return acc


@triton.jit
def q6_k_codes(qa, qb, qh, K: tl.constexpr):
    """Q6_K's 6-bit codes (0..63) of k = K (0..3) of a half super-block, from its ql bytes
    (qa: k 0 low nibbles, 2 high; qb: k 1, 3) and qh bytes: each an int32 holding one byte
    (values 32k + l of byte l) or four (a word of four consecutive l); the top two bits at
    shift 2k of qh."""
    if K % 2 == 0:  # noqa: SIM108 (a static branch, which Triton compiles away)
        low = qa
    else:
        low = qb
    if K < 2:  # noqa: SIM108
        low = low & 0x0F0F0F0F
    else:
        low = (low >> 4) & 0x0F0F0F0F
    return low | (((qh >> (2 * K)) & 0x03030303) << 4)


@triton.jit
def _q6_k_rows_dot(
    w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N: tl.constexpr, SBS: tl.constexpr
):
    """Q6_K (210 bytes: ql 128 | qh 64 | int8 scales 16 | d), SBS super-blocks per step.
    Half n of a super-block holds values 128n + 32k + l (k 0..3, l 0..31): low 4 bits in
    ql[64n + l] (k 0, 2: low nibble of ql[.. + 32 (k odd)]; k 2, 3: high nibble), top 2 bits
    at shift 2k of qh[32n + l], scale sc[8n + 2k + l // 16]. The tile is
    [BN, (super-block, n), l // 16, l % 16]."""
    hn = tl.arange(0, 2 * SBS)[None, :, None, None]  # (super-block of the step, half)
    g = tl.arange(0, 2)[None, None, :, None]
    l16 = tl.arange(0, 16)[None, None, None, :]
    lane = g * 16 + l16  # l: 0..31
    hn3 = tl.arange(0, 2 * SBS)[None, :, None]
    g3 = tl.arange(0, 2)[None, None, :]
    hn2 = tl.arange(0, 2 * SBS)[None, :]
    rows64 = rows.to(tl.int64)
    nsb = K // 256
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb0 in range(0, nsb, SBS):
        sb, n = sb0 + hn // 2, hn % 2
        smask = sb < nsb
        mask4 = row_mask[:, None, None, None] & smask
        blk = w_ptr + rows64[:, None, None, None] * ROW_BYTES + sb * 210
        qa = tl.load(blk + 64 * n + lane, mask=mask4, other=0).to(tl.int32)
        qb = tl.load(blk + 64 * n + 32 + lane, mask=mask4, other=0).to(tl.int32)
        qh = tl.load(blk + 128 + 32 * n + lane, mask=mask4, other=0).to(tl.int32)
        xb = x_ptr + sb * 256 + 128 * n + lane  # [1, HN, 2, 16]
        sb3, n3 = sb0 + hn3 // 2, hn3 % 2
        mask3 = row_mask[:, None, None] & (sb3 < nsb)
        sc_at = w_ptr + rows64[:, None, None] * ROW_BYTES + sb3 * 210 + 192
        part = tl.zeros([BLOCK_N, 2 * SBS, 2], dtype=tl.float32)
        for k in tl.static_range(4):
            q = q6_k_codes(qa, qb, qh, k) - 32
            x = tl.load(xb + 32 * k, mask=smask, other=0.0).to(tl.float32)
            dot = tl.sum(q.to(tl.float32) * x, axis=3)  # [BN, HN, 2]
            sc = tl.load(sc_at + 8 * n3 + 2 * k + g3, mask=mask3, other=0).to(tl.int8, bitcast=True)
            part += sc.to(tl.float32) * dot
        sb2 = sb0 + hn2 // 2
        d_at = w_ptr + rows64[:, None] * ROW_BYTES + sb2 * 210 + 208  # [BN, HN]
        d = _load_f16(d_at, row_mask[:, None] & (sb2 < nsb))
        acc += tl.sum(tl.sum(part, axis=2) * d, axis=1)
    return acc


@triton.jit
def _eight_blocks(w_ptr, rows, row_mask, ROW_BYTES):
    """A row dot of eight 32-value blocks a step: (the blocks' index [1, 8, 1] and [1, 8], the
    rows' mask [BN, 1, 1], their byte addresses [BN, 1, 1] and [BN, 1])."""
    at = rows.to(tl.int64)
    return (tl.arange(0, 8)[None, :, None], tl.arange(0, 8)[None, :], row_mask[:, None, None],
            w_ptr + at[:, None, None] * ROW_BYTES, w_ptr + at[:, None] * ROW_BYTES)  # fmt: skip


@triton.jit
def _q8_0_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N: tl.constexpr):
    """Q8_0 (34 bytes: d | 32 int8), eight blocks a step: [BN, 8, 32] quants, [BN, 8] scales."""
    blk, blk2, mask3, row, row2 = _eight_blocks(w_ptr, rows, row_mask, ROW_BYTES)
    j = tl.arange(0, 32)[None, None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    nb = K // 32
    for b0 in range(0, nb, 8):
        bmask = (b0 + blk) < nb  # [1, 8, 1]
        at = row + (b0 + blk) * 34  # [BN, 8, 1]
        q = tl.load(at + 2 + j, mask=mask3 & bmask, other=0).to(tl.int8, bitcast=True)
        x = tl.load(x_ptr + (b0 + blk) * 32 + j, mask=bmask, other=0.0).to(tl.float32)
        dot = tl.sum(q.to(tl.float32) * x, axis=2)  # [BN, 8]
        dmask = row_mask[:, None] & ((b0 + blk2) < nb)  # [BN, 8]
        d = _load_f16(row2 + (b0 + blk2) * 34, dmask)
        acc += tl.sum(d * dot, axis=1)
    return acc


@triton.jit
def _q2_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N: tl.constexpr):
    """Q2_K (84 bytes: scales 16 | qs 64 | d | dmin), rows and blocks 4-byte aligned: the
    codes as 32-bit words [half n, group h, word w]: bits 2j of byte b hold value
    128n + 32j + 16h + 4w + b, of sub-block 8n + 2j + h (scale low nibble, min high)."""
    rows64 = rows.to(tl.int64)[:, None, None, None]
    n = tl.arange(0, 2)[None, :, None, None]
    h = tl.arange(0, 2)[None, None, :, None]
    w = tl.arange(0, 4)[None, None, None, :]
    mask4 = row_mask[:, None, None, None]
    n3 = tl.arange(0, 2)[None, :, None]
    h3 = tl.arange(0, 2)[None, None, :]
    mask3 = row_mask[:, None, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = w_ptr + rows64 * ROW_BYTES + sb * 84
        q = tl.load((blk + 16 + 32 * n + 16 * h + 4 * w).to(tl.pointer_type(tl.int32)),
                    mask=mask4, other=0)  # fmt: skip  # [BN, 2, 2, 4]
        head = w_ptr + rows.to(tl.int64)[:, None, None] * ROW_BYTES + sb * 84  # [BN, 1, 1]
        d = _load_f16(head + 80, mask3)
        dmin = _load_f16(head + 82, mask3)
        part = tl.zeros([BLOCK_N, 2, 2], dtype=tl.float32)
        for j in tl.static_range(4):
            dot = tl.zeros([BLOCK_N, 2, 2, 4], dtype=tl.float32)
            xs = tl.zeros([1, 2, 2, 4], dtype=tl.float32)
            for b in tl.static_range(4):
                x = tl.load(x_ptr + sb * 256 + 128 * n + 32 * j + 16 * h + 4 * w + b)
                x = x.to(tl.float32)
                dot += ((q >> (8 * b + 2 * j)) & 3).to(tl.float32) * x
                xs += x
            sc = tl.load(head + 8 * n3 + 2 * j + h3, mask=mask3, other=0).to(tl.int32)
            part += (d * (sc & 0xF).to(tl.float32)) * tl.sum(dot, axis=3)
            part -= (dmin * (sc >> 4).to(tl.float32)) * tl.sum(xs, axis=3)
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    return acc


@triton.jit
def _q3_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N: tl.constexpr):
    """Q3_K (110 bytes: hmask 32 | qs 64 | scales 12 | d): a super-block as [half n, group h,
    16]: byte qs[32n + l] holds at shift 2j the low 2 bits of value 128n + 32j + l (l = 16h +
    lane), bit 4n + j of hmask[l] its high bit (clear: minus 4); sub-block 8n + 2j + h has a
    6-bit signed scale. One qs and one hmask load serve 4 and 8 weights."""
    rows64 = rows.to(tl.int64)[:, None, None, None]
    n = tl.arange(0, 2)[None, :, None, None]
    h = tl.arange(0, 2)[None, None, :, None]
    lane = tl.arange(0, 16)[None, None, None, :]
    mask4 = row_mask[:, None, None, None]
    n3 = tl.arange(0, 2)[None, :, None]
    h3 = tl.arange(0, 2)[None, None, :]
    mask3 = row_mask[:, None, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = w_ptr + rows64 * ROW_BYTES + sb * 110
        l = 16 * h + lane  # noqa: E741 (llama.cpp's name)
        qs = tl.load(blk + 32 + 32 * n + l, mask=mask4, other=0).to(tl.int32)  # [BN, 2, 2, 16]
        hm = tl.load(blk + l, mask=mask4, other=0).to(tl.int32)  # [BN, 1, 2, 16]
        head = w_ptr + rows.to(tl.int64)[:, None, None] * ROW_BYTES + sb * 110  # [BN, 1, 1]
        part = tl.zeros([BLOCK_N, 2, 2], dtype=tl.float32)
        for j in tl.static_range(4):
            q = ((qs >> (2 * j)) & 3) - 4 * (1 - ((hm >> (4 * n + j)) & 1))
            x = tl.load(x_ptr + sb * 256 + 128 * n + 32 * j + l).to(tl.float32)
            dot = tl.sum(q.to(tl.float32) * x, axis=3)  # [BN, 2, 2]
            s = 8 * n3 + 2 * j + h3  # [1, 2, 2]
            low = (tl.load(head + 96 + s % 8, mask=mask3, other=0).to(tl.int32) >> (4 * (s // 8)))
            high = tl.load(head + 104 + s % 4, mask=mask3, other=0).to(tl.int32) >> (2 * (s // 4))
            sc = ((low & 0xF) | ((high & 3) << 4)) - 32
            part += sc.to(tl.float32) * dot
        d = _load_f16(head + 108, mask3)  # [BN, 1, 1]
        acc += tl.sum(tl.sum(part * d, axis=2), axis=1)
    return acc


@triton.jit
def blocks_rows_dot(
    w_ptr,
    rows,
    row_mask,
    x_ptr,
    K,
    ROW_BYTES,
    tab_ptr,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr,
    SBS: tl.constexpr,
):
    """Rows of a projection of GGUF blocks of QTYPE dot x [K] (ALIGNED: rows and blobs on 16
    bytes; SBS: the K-quants' super-blocks per step)."""
    if QTYPE == Q4_K and ALIGNED:
        acc = _q45_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N, False, SBS)
    elif QTYPE == Q5_K and ALIGNED:
        acc = _q45_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N, True, SBS)
    elif QTYPE == IQ4_XS and ALIGNED:
        acc = _iq4_xs_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, BLOCK_N)
    elif QTYPE == Q2_K and ALIGNED:
        acc = _q2_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N)
    elif QTYPE == Q3_K:
        acc = _q3_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N)
    elif QTYPE == Q6_K:
        acc = _q6_k_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N, SBS)
    elif QTYPE == Q8_0:
        acc = _q8_0_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, BLOCK_N)
    elif QTYPE == IQ3_S:
        acc = _iq3_s_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, BLOCK_N)
    elif (GRID_BITS >> QTYPE) & 1:  # QTYPE in GRID_QTYPES
        acc = _grid_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, QTYPE, BLOCK_N)
    else:
        acc = _values_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, QTYPE,
                               BLOCK_N, BLOCK_K)  # fmt: skip
    return acc
