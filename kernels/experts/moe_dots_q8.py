"""Int8 row dots of the fused MoE kernels: the activation quantized once, the weights' codes
multiplied four at a time in integers.

The float readers (`kernels.experts.moe_dots`) turn every 4- or 6-bit code into a float and multiply
it: shift, mask, convert and fused multiply-add per weight. On the H100 that bounds a Q4_K
expert layer by its arithmetic (63 us a layer at a3b's shapes, 13% of the copy rate, where
Q4_0's lighter reader reaches 27%). Here, as in llama.cpp's decode kernels, the activation is
first quantized to 8 bits per 32 values (`quantize_q8`: a scale per 32 and a sum per 16), the
codes stay packed four to a 32-bit word (`& 0x0F0F0F0F` takes four nibbles at once), and one
`dp4a` instruction multiplies four code bytes by four activation bytes and adds the products
into an int32. Each (sub-)block's integer dot is scaled once: for Q4_K,
`d sc xd sum(q xq) - dmin m sum(x)` (Q5_K alike, its fifth bits OR-ed into the words); for
Q6_K, `d sc (xd sum(q xq) - 32 sum(x))`; for Q8_0, `d xd sum(q xq)`.

A Q8 row of K values (K a multiple of 32) is `K` int8 codes, then K / 32 float32 scales,
then K / 16 float32 sums (each the scale times the sum of 16 codes): `q8_row_bytes(K)` bytes,
a multiple of 4. `quantize_q8_ref` is its torch definition.

`dp4a` is inline PTX on NVIDIA; elsewhere (ROCm, Triton's interpreter) the same integers come
from shifts and multiplies (`_dp4a(..., ASM=False)`), so the result does not depend on the
path. The readers need the blobs 4-byte aligned (Q4_K's and Q5_K's words) or 2-byte aligned
(Q6_K's 210-byte and Q8_0's 34-byte blocks, read as 16-bit halves): the launchers use them only
where the caller vouches for aligned blobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.experts.moe_dots import q6_k_codes
from kernels.formats.byte_loads import _load_f16
from kernels.formats.quant import QType

Q8_BLOCK = 32  # values per activation scale
Q4_K: tl.constexpr = tl.constexpr(int(QType.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(QType.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(QType.Q6_K))
# the weight types with an int8 reader here
Q8_DOT_QTYPES: frozenset[QType] = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0})


def q8_row_bytes(k: int) -> int:
    """Bytes of a Q8 row of `k` values: codes, scales per 32, sums per 16."""
    if k % Q8_BLOCK:
        raise ValueError(f"a Q8 row needs a multiple of {Q8_BLOCK} values, got {k}")
    return k + 4 * (k // 32) + 4 * (k // 16)


def dp4a_in_asm(device: torch.device) -> bool:
    """Whether the kernels on `device` take NVIDIA's dp4a instruction (else its emulation)."""
    return device.type == "cuda" and torch.version.hip is None


# --- Triton ------------------------------------------------------------------------------


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Per element: the sum of the four products of a's and b's signed bytes (int32)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            out += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    return out


@triton.jit
def _quantize_q8_kernel(x_ptr, out_ptr, K, ROW_BYTES, BLOCKS: tl.constexpr):
    """Program (row, chunk): BLOCKS 32-value blocks of row `row` of x [R, K] into its Q8 row."""
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # [B]
    bmask = blk < K // 32
    col = blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [B, 32]
    x = tl.load(x_ptr + r * K + col, mask=bmask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [B]
    d = amax / 127.0
    inv = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
    v = x * inv[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)  # half away
    row = out_ptr + r * ROW_BYTES
    tl.store(row + col, q.to(tl.int8), mask=bmask[:, None])
    tl.store((row + K).to(tl.pointer_type(tl.float32)) + blk, d, mask=bmask)
    half = tl.reshape(q, [BLOCKS, 2, 16])
    s16 = tl.sum(half, axis=2).to(tl.float32) * d[:, None]  # [B, 2]
    at = blk[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store((row + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32)) + at, s16,
             mask=bmask[:, None])  # fmt: skip


@triton.jit
def _load_i32_halves(ptr, mask):
    """The little-endian 32-bit word at the 2-byte aligned byte address `ptr`."""
    p16 = ptr.to(tl.pointer_type(tl.uint16))
    lo = tl.load(p16, mask=mask, other=0).to(tl.int32)
    hi = tl.load(p16 + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _f16_low(w):
    """The fp16 in the low 16 bits of the int32 word w, as float32."""
    return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min_words(w1, w2, w3, sub):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block `sub` (0..7) from the 12 packed scale bytes
    read as three little-endian words (bytes 0-3, 4-7, 8-11: `kernels.layers.gemv
    ._k_scale_min` reads the same bits a byte at a time)."""
    shift = 8 * (sub % 4)
    b_d = (w1 >> shift) & 0xFF  # scales 0-3, top bits of scales 4-7
    b_m = (w2 >> shift) & 0xFF  # mins 0-3, top bits of mins 4-7
    b_hi = (w3 >> shift) & 0xFF  # low nibbles of scales / mins 4-7
    sc = tl.where(sub < 4, b_d & 63, (b_hi & 0xF) | ((b_d >> 6) << 4))
    mn = tl.where(sub < 4, b_m & 63, (b_hi >> 4) | ((b_m >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q45_k_codes(r32, sb, pair, word, mask, FIVE_BIT: tl.constexpr):
    """The (low, high) nibble words of [BN, S, 4, 8] (row, super-block, pair, word) of a Q4_K
    or Q5_K matrix whose rows start at the int32 pointers r32 [BN] (Q5_K: the fifth bits
    OR-ed in)."""
    words = 36 + 8 * FIVE_BIT  # a block's 144 or 176 bytes
    blk = r32[:, None, None, None] + sb * words
    q = tl.load(blk + (words - 32) + pair * 8 + word, mask=mask, other=0)
    lo = q & 0x0F0F0F0F
    hi = (q >> 4) & 0x0F0F0F0F
    if FIVE_BIT:
        qh = tl.load(blk + 4 + word, mask=mask, other=0)
        lo = lo | (((qh >> (2 * pair)) & 0x01010101) << 4)
        hi = hi | (((qh >> (2 * pair + 1)) & 0x01010101) << 4)
    return lo, hi


@triton.jit
def _q45_k_scaled(r32, sb, pair, mask, i_lo, i_hi, xd_lo, xd_hi, xs_lo, xs_hi,
                  FIVE_BIT: tl.constexpr):  # fmt: skip
    """[BN] float32: the integer dots i_lo / i_hi [BN, S, 4] of (row, super-block, pair)
    scaled by the blocks' d, dmin and 6-bit scales and mins and the activation's, summed."""
    head = r32[:, None, None] + sb * (36 + 8 * FIVE_BIT)
    w0 = tl.load(head, mask=mask, other=0)  # d | dmin
    w1 = tl.load(head + 1, mask=mask, other=0)
    w2 = tl.load(head + 2, mask=mask, other=0)
    w3 = tl.load(head + 3, mask=mask, other=0)
    d, dmin = _f16_low(w0), _f16_low(w0 >> 16)
    sc_lo, m_lo = _k_scale_min_words(w1, w2, w3, 2 * pair)
    sc_hi, m_hi = _k_scale_min_words(w1, w2, w3, 2 * pair + 1)
    part = (d * sc_lo) * (xd_lo * i_lo.to(tl.float32)) - (dmin * m_lo) * xs_lo
    part += (d * sc_hi) * (xd_hi * i_hi.to(tl.float32)) - (dmin * m_hi) * xs_hi
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _q45_k_rows_dot_q8(
    a_at, b_at, row_mask, x8_ptr, K, BLOCK_N: tl.constexpr, SBS: tl.constexpr,
    FIVE_BIT: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """([BLOCK_N], [BLOCK_N]) float32: rows of a Q4_K (144-byte blocks) or Q5_K matrix (176: a
    32-byte plane of fifth bits before the nibbles) at a_at, and with TWO of a second matrix
    of the type and shape at b_at (gate and up: the activation's words are read once for
    both; else the second is zeros), dot the Q8 row at x8_ptr. Rows start 4-byte aligned.
    Every address is taken in 32-bit words, so where the rows start on 16 bytes the compiler
    sees eight consecutive words of a (row, super-block, pair) and loads them 16 bytes at a
    time. Pair p of a super-block holds in word w's byte b the codes of values 64p + 4w + b
    (low nibble) and 64p + 32 + 4w + b (high nibble), so a word's four nibbles meet four
    consecutive codes of the activation; Q5_K's fifth bits of those values are bits 2p and
    2p + 1 of the plane's word w. The tile is [BN, super-block of the step, pair, word]."""
    a32 = a_at.to(tl.pointer_type(tl.int32))
    b32 = b_at.to(tl.pointer_type(tl.int32))
    x32 = x8_ptr.to(tl.pointer_type(tl.int32))
    xd_ptr = (x8_ptr + K).to(tl.pointer_type(tl.float32))
    xs_ptr = (x8_ptr + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32))
    s4 = tl.arange(0, SBS)[None, :, None, None]
    pair4 = tl.arange(0, 4)[None, None, :, None]
    word = tl.arange(0, 8)[None, None, None, :]
    s3 = tl.arange(0, SBS)[None, :, None]
    pair = tl.arange(0, 4)[None, None, :]
    acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    nsb = K // 256
    for sb0 in range(0, nsb, SBS):
        sb4 = sb0 + s4
        in4 = sb4 < nsb
        mask4 = row_mask[:, None, None, None] & in4
        xw = x32 + sb4 * 64 + pair4 * 16 + word  # [1, S, 4, 8]: the low nibbles' codes
        zero = tl.zeros([BLOCK_N, SBS, 4, 8], dtype=tl.int32)
        x_lo = tl.load(xw, mask=in4, other=0) + zero
        x_hi = tl.load(xw + 8, mask=in4, other=0) + zero
        sb = sb0 + s3
        inb = sb < nsb
        mask = row_mask[:, None, None] & inb
        b32i = sb * 8 + 2 * pair  # [1, S, 4]: the activation's block of the low nibbles
        xd_lo = tl.load(xd_ptr + b32i, mask=inb, other=0.0)
        xd_hi = tl.load(xd_ptr + b32i + 1, mask=inb, other=0.0)
        xs_lo = tl.load(xs_ptr + 2 * b32i, mask=inb, other=0.0)
        xs_lo += tl.load(xs_ptr + 2 * b32i + 1, mask=inb, other=0.0)
        xs_hi = tl.load(xs_ptr + 2 * b32i + 2, mask=inb, other=0.0)
        xs_hi += tl.load(xs_ptr + 2 * b32i + 3, mask=inb, other=0.0)
        lo, hi = _q45_k_codes(a32, sb4, pair4, word, mask4, FIVE_BIT)
        i_lo = tl.sum(_dp4a(lo, x_lo, ASM), axis=3)  # [BN, S, 4]
        i_hi = tl.sum(_dp4a(hi, x_hi, ASM), axis=3)
        acc_a += _q45_k_scaled(a32, sb, pair, mask, i_lo, i_hi, xd_lo, xd_hi, xs_lo, xs_hi,
                               FIVE_BIT)  # fmt: skip
        if TWO:
            lo, hi = _q45_k_codes(b32, sb4, pair4, word, mask4, FIVE_BIT)
            i_lo = tl.sum(_dp4a(lo, x_lo, ASM), axis=3)
            i_hi = tl.sum(_dp4a(hi, x_hi, ASM), axis=3)
            acc_b += _q45_k_scaled(b32, sb, pair, mask, i_lo, i_hi, xd_lo, xd_hi, xs_lo,
                                   xs_hi, FIVE_BIT)  # fmt: skip
    return acc_a, acc_b


@triton.jit
def _q6_k_rows_dot_q8(
    row_at, row_mask, x8_ptr, K, BLOCK_N: tl.constexpr, SBS: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] float32: rows of a Q6_K matrix (210-byte blocks: ql 128 | qh 64 | int8
    scales 16 | d; 2-byte aligned) dot the Q8 row at x8_ptr. Half n of a super-block holds
    values 128n + 32k + l (k 0..3, l 0..31): low 4 bits in ql[64n + l] (+ 32 for odd k; high
    nibble for k 2, 3), top 2 bits at shift 2k of qh[32n + l], scale sc[8n + 2k + l // 16].
    Four consecutive l make a word of 6-bit codes (0..63) for four consecutive activation
    codes. The tile is [BN, (super-block, n), l // 16, word of the 16]."""
    xd_ptr = (x8_ptr + K).to(tl.pointer_type(tl.float32))
    xs_ptr = (x8_ptr + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32))
    hn = tl.arange(0, 2 * SBS)[None, :, None, None]  # (super-block of the step, half)
    g = tl.arange(0, 2)[None, None, :, None]
    w4 = tl.arange(0, 4)[None, None, None, :]
    lane = g * 16 + w4 * 4  # l of the word's first byte
    hn3 = tl.arange(0, 2 * SBS)[None, :, None]
    g3 = tl.arange(0, 2)[None, None, :]
    hn2 = tl.arange(0, 2 * SBS)[None, :]
    nsb = K // 256
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb0 in range(0, nsb, SBS):
        sb, n = sb0 + hn // 2, hn % 2
        smask = sb < nsb
        mask4 = row_mask[:, None, None, None] & smask
        blk = row_at[:, None, None, None] + sb * 210
        qa = _load_i32_halves(blk + 64 * n + lane, mask4)
        qb = _load_i32_halves(blk + 64 * n + 32 + lane, mask4)
        qh = _load_i32_halves(blk + 128 + 32 * n + lane, mask4)
        xw = x8_ptr + sb * 256 + 128 * n + lane  # [1, HN, 2, 4]
        sb3, n3 = sb0 + hn3 // 2, hn3 % 2
        smask3 = sb3 < nsb
        mask3 = row_mask[:, None, None] & smask3
        sc_at = row_at[:, None, None] + sb3 * 210 + 192
        zero = tl.zeros_like(qa)
        part = tl.zeros([BLOCK_N, 2 * SBS, 2], dtype=tl.float32)
        for k in tl.static_range(4):
            q = q6_k_codes(qa, qb, qh, k)
            xk = tl.load((xw + 32 * k).to(tl.pointer_type(tl.int32)), mask=smask, other=0)
            i16 = tl.sum(_dp4a(q, xk + zero, ASM), axis=3)  # [BN, HN, 2]
            sc = tl.load(sc_at + 8 * n3 + 2 * k + g3, mask=mask3, other=0).to(tl.int8, bitcast=True)
            xd = tl.load(xd_ptr + sb3 * 8 + 4 * n3 + k, mask=smask3, other=0.0)  # [1, HN, 1]
            xs = tl.load(xs_ptr + sb3 * 16 + 8 * n3 + 2 * k + g3, mask=smask3, other=0.0)
            part += sc.to(tl.float32) * (xd * i16.to(tl.float32) - 32.0 * xs)
        sb2 = sb0 + hn2 // 2
        d_at = row_at[:, None] + sb2 * 210 + 208  # [BN, HN]
        d = _load_f16(d_at, row_mask[:, None] & (sb2 < nsb))
        acc += tl.sum(tl.sum(part, axis=2) * d, axis=1)
    return acc


@triton.jit
def q6_k_split_rows_dot(
    w_ptr, rows, row_mask, x8_ptr, K, N, BLOCK_N: tl.constexpr, SBS: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] float32: rows `rows` of a Q6_K matrix [N, K] in the split layout
    (`kernels.experts.moe.split_q6_k`: every block's first 208 bytes, ql | qh | scales, then
    every block's fp16 d; 16-byte aligned at w_ptr) dot the Q8 row at x8_ptr. The codes are
    those of `_q6_k_rows_dot_q8`, read as 32-bit words: the eight words of (row, half,
    l // 16) are consecutive, so they load 16 bytes at a time, and a half's four scale bytes
    of each l // 16 come as two words. The tile is [BN, (super-block, n), l // 16, word of the
    16]."""
    nb = K // 256
    body = w_ptr.to(tl.pointer_type(tl.int32))  # 52 words a block: ql 0-31, qh 32-47, sc 48-51
    ds = (w_ptr + N * nb * 208).to(tl.pointer_type(tl.float16))
    x32 = x8_ptr.to(tl.pointer_type(tl.int32))
    xd_ptr = (x8_ptr + K).to(tl.pointer_type(tl.float32))
    xs_ptr = (x8_ptr + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32))
    blk_row = rows.to(tl.int64) * nb  # [BN]: the row's first block
    hn = tl.arange(0, 2 * SBS)[None, :, None, None]  # (super-block of the step, half)
    g = tl.arange(0, 2)[None, None, :, None]  # l // 16
    w4 = tl.arange(0, 4)[None, None, None, :]
    hn3 = tl.arange(0, 2 * SBS)[None, :, None]
    g3 = tl.arange(0, 2)[None, None, :]
    hn2 = tl.arange(0, 2 * SBS)[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb0 in range(0, nb, SBS):
        sb, n = sb0 + hn // 2, hn % 2
        smask = sb < nb
        mask4 = row_mask[:, None, None, None] & smask
        blk = (blk_row[:, None, None, None] + sb) * 52 + 4 * g + w4  # word of l = 16g + 4w4
        qa = tl.load(body + blk + 16 * n, mask=mask4, other=0)  # ql[64n + l]: k 0, 2
        qb = tl.load(body + blk + 16 * n + 8, mask=mask4, other=0)  # ql[64n + 32 + l]: k 1, 3
        qh = tl.load(body + blk + 32 + 8 * n, mask=mask4, other=0)  # qh[32n + l]
        xw = x32 + sb * 64 + 32 * n + 4 * g + w4  # [1, HN, 2, 4]: values 128n + l (k = 0)
        sb3, n3 = sb0 + hn3 // 2, hn3 % 2
        smask3 = sb3 < nb
        mask3 = row_mask[:, None, None] & smask3
        sc_at = body + (blk_row[:, None, None] + sb3) * 52 + 48 + 2 * n3  # [BN, HN, 1]
        sc01 = tl.load(sc_at, mask=mask3, other=0)  # sc[8n + 0..3]: k 0, 1
        sc23 = tl.load(sc_at + 1, mask=mask3, other=0)  # sc[8n + 4..7]: k 2, 3
        zero = tl.zeros_like(qa)
        part = tl.zeros([BLOCK_N, 2 * SBS, 2], dtype=tl.float32)
        for k in tl.static_range(4):
            q = q6_k_codes(qa, qb, qh, k)
            xk = tl.load(xw + 8 * k, mask=smask, other=0) + zero
            i16 = tl.sum(_dp4a(q, xk, ASM), axis=3)  # [BN, HN, 2]
            if k < 2:  # noqa: SIM108 (a static branch, which Triton compiles away)
                word = sc01
            else:
                word = sc23
            sc = ((word >> (8 * (2 * (k % 2) + g3))) << 24) >> 24  # sc[8n + 2k + g], signed
            xd = tl.load(xd_ptr + sb3 * 8 + 4 * n3 + k, mask=smask3, other=0.0)  # [1, HN, 1]
            xs = tl.load(xs_ptr + sb3 * 16 + 8 * n3 + 2 * k + g3, mask=smask3, other=0.0)
            part += sc.to(tl.float32) * (xd * i16.to(tl.float32) - 32.0 * xs)
        sb2 = sb0 + hn2 // 2
        d = tl.load(ds + blk_row[:, None] + sb2, mask=row_mask[:, None] & (sb2 < nb), other=0.0)
        acc += tl.sum(tl.sum(part, axis=2) * d.to(tl.float32), axis=1)
    return acc


@triton.jit
def _q8_0_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N] float32: rows of a Q8_0 matrix (34-byte blocks: d | 32 int8; 2-byte aligned)
    dot the Q8 row at x8_ptr, eight blocks a step: [BN, 8, 8] words of codes."""
    xd_ptr = (x8_ptr + K).to(tl.pointer_type(tl.float32))
    blk = tl.arange(0, 8)[None, :, None]
    blk2 = tl.arange(0, 8)[None, :]
    word = tl.arange(0, 8)[None, None, :]
    row = row_at[:, None, None]  # [BN, 1, 1]
    row2 = row_at[:, None]  # [BN, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    nb = K // 32
    for b0 in range(0, nb, 8):
        bmask = (b0 + blk) < nb  # [1, 8, 1]
        q = _load_i32_halves(row + (b0 + blk) * 34 + 2 + word * 4, row_mask[:, None, None] & bmask)
        xw = (x8_ptr + (b0 + blk) * 32 + word * 4).to(tl.pointer_type(tl.int32))
        xq = tl.load(xw, mask=bmask, other=0)
        dot = tl.sum(_dp4a(q, xq + tl.zeros_like(q), ASM), axis=2)  # [BN, 8]
        bmask2 = (b0 + blk2) < nb
        d = _load_f16(row2 + (b0 + blk2) * 34, row_mask[:, None] & bmask2)
        xd = tl.load(xd_ptr + b0 + blk2, mask=bmask2, other=0.0)  # [1, 8]
        acc += tl.sum(d * xd * dot.to(tl.float32), axis=1)
    return acc


@triton.jit
def q8_rows_dot(
    row_at, row_mask, x8_ptr, K, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, SBS: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] float32: rows of GGUF blocks of QTYPE (one of `Q8_DOT_QTYPES`), each at
    its own byte address (`row_at` [BLOCK_N], uint8 pointers), dot the Q8 row at x8_ptr."""
    if QTYPE == Q4_K:
        acc, _ = _q45_k_rows_dot_q8(row_at, row_at, row_mask, x8_ptr, K, BLOCK_N, SBS, False,
                                    False, ASM)  # fmt: skip
    elif QTYPE == Q5_K:
        acc, _ = _q45_k_rows_dot_q8(row_at, row_at, row_mask, x8_ptr, K, BLOCK_N, SBS, True,
                                    False, ASM)  # fmt: skip
    elif QTYPE == Q6_K:
        acc = _q6_k_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N, SBS, ASM)
    else:
        acc = _q8_0_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N, ASM)
    return acc


@triton.jit
def q8_rows_dot2(
    a_at, b_at, row_mask, x8_ptr, K, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    SBS: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """`q8_rows_dot` of two matrices of one type and shape (gate and up) with one Q8 row:
    Q4_K and Q5_K read the activation once for both; each row's sum is the one `q8_rows_dot`
    gives it alone."""
    if QTYPE == Q4_K:
        a, b = _q45_k_rows_dot_q8(a_at, b_at, row_mask, x8_ptr, K, BLOCK_N, SBS, False, True, ASM)
    elif QTYPE == Q5_K:
        a, b = _q45_k_rows_dot_q8(a_at, b_at, row_mask, x8_ptr, K, BLOCK_N, SBS, True, True, ASM)
    else:
        a = q8_rows_dot(a_at, row_mask, x8_ptr, K, QTYPE, BLOCK_N, SBS, ASM)
        b = q8_rows_dot(b_at, row_mask, x8_ptr, K, QTYPE, BLOCK_N, SBS, ASM)
    return a, b


# --- launcher and reference ----------------------------------------------------------------


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] (float, contiguous) -> its Q8 rows, uint8 [R, q8_row_bytes(K)]."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [R, K], got {tuple(x.shape)}")
    r, k = x.shape
    out = torch.empty(r, q8_row_bytes(k), dtype=torch.uint8, device=x.device)
    blocks = min(32, triton.next_power_of_2(k // 32))
    _quantize_q8_kernel[(r, triton.cdiv(k // 32, blocks))](x, out, k, out.shape[1], BLOCKS=blocks)
    return out


def quantize_q8_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch definition of `quantize_q8` (the same float32 steps)."""
    r, k = x.shape
    xb = x.float().reshape(r, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    v = xb * inv[..., None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v)).to(torch.int32)
    s16 = q.reshape(r, k // 16, 16).sum(-1).float() * d.repeat_interleave(2, -1)
    parts = [
        q.to(torch.int8).reshape(r, k).view(torch.uint8),
        d.contiguous().view(torch.uint8).reshape(r, -1),
        s16.contiguous().view(torch.uint8).reshape(r, -1),
    ]
    return torch.cat(parts, 1)


def dequantize_q8_ref(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Q8 rows [R, q8_row_bytes(k)] -> the values they stand for, float32 [R, k]."""
    q = rows[:, :k].contiguous().view(torch.int8).float()
    d = rows[:, k : k + 4 * (k // 32)].contiguous().view(torch.float32)
    return (q.reshape(-1, k // 32, 32) * d[..., None]).reshape(-1, k)
