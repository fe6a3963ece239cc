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

from kernels.formats.byte_loads import _load_f16
from kernels.formats.quant import QType
from kernels.layers.gemv import _k_scale_min

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
def _q45_k_rows_dot_q8(
    row_at, row_mask, x8_ptr, K, BLOCK_N: tl.constexpr, SBS: tl.constexpr,
    FIVE_BIT: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] float32: rows of a Q4_K (144-byte blocks) or Q5_K matrix (176: a 32-byte plane
    of fifth bits before the nibbles; 16-byte aligned) dot the Q8 row at x8_ptr. The tile is
    that of `moe_dots._q45_k_rows_dot`: [BN, (super-block, pair), word], byte b of word w of
    pair p holding value 64p + 4w + b (low nibble) and 64p + 32 + 4w + b (high nibble), so a
    word's four nibbles meet four consecutive codes of the activation, one 32-bit load; Q5_K's
    fifth bits of those values are bits 2p and 2p + 1 of the plane's word w."""
    xd_ptr = (x8_ptr + K).to(tl.pointer_type(tl.float32))
    xs_ptr = (x8_ptr + K + 4 * (K // 32)).to(tl.pointer_type(tl.float32))
    sp = tl.arange(0, 4 * SBS)[None, :, None]  # [1, P, 1]: (super-block of the step, pair)
    word = tl.arange(0, 8)[None, None, :]  # [1, 1, 8]
    sp2 = tl.arange(0, 4 * SBS)[None, :]  # [1, P]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    nsb = K // 256
    nbytes = 144 + 32 * FIVE_BIT  # the block's bytes
    for sb0 in range(0, nsb, SBS):
        sb, pair = sb0 + sp // 4, sp % 4
        smask = sb < nsb
        mask3 = row_mask[:, None, None] & smask
        blk = row_at[:, None, None] + sb * nbytes
        q = tl.load((blk + nbytes - 128 + pair * 32 + word * 4).to(tl.pointer_type(tl.int32)),
                    mask=mask3, other=0)  # fmt: skip
        lo = q & 0x0F0F0F0F
        hi = (q >> 4) & 0x0F0F0F0F
        if FIVE_BIT:
            qh = tl.load((blk + 16 + word * 4).to(tl.pointer_type(tl.int32)), mask=mask3, other=0)
            lo = lo | (((qh >> (2 * pair)) & 0x01010101) << 4)
            hi = hi | (((qh >> (2 * pair + 1)) & 0x01010101) << 4)
        xw = x8_ptr + sb * 256 + pair * 64 + word * 4  # [1, P, 8]
        x_lo = tl.load(xw.to(tl.pointer_type(tl.int32)), mask=smask, other=0)
        x_hi = tl.load((xw + 32).to(tl.pointer_type(tl.int32)), mask=smask, other=0)
        zero = tl.zeros_like(q)
        i_lo = tl.sum(_dp4a(lo, x_lo + zero, ASM), axis=2)  # [BN, P]
        i_hi = tl.sum(_dp4a(hi, x_hi + zero, ASM), axis=2)
        sb2, pair2 = sb0 + sp2 // 4, sp2 % 4
        smask2 = sb2 < nsb
        hmask = row_mask[:, None] & smask2  # [BN, P]
        head = row_at[:, None] + sb2 * nbytes
        d = _load_f16(head, hmask)
        dmin = _load_f16(head + 2, hmask)
        sub = 2 * pair2  # the low nibbles' sub-block
        sc_lo, m_lo = _k_scale_min(head + 4, sub, hmask)
        sc_hi, m_hi = _k_scale_min(head + 4, sub + 1, hmask)
        b32 = sb2 * 8 + sub  # [1, P]: the activation's block of the low nibbles
        xd_lo = tl.load(xd_ptr + b32, mask=smask2, other=0.0)
        xd_hi = tl.load(xd_ptr + b32 + 1, mask=smask2, other=0.0)
        xs_lo = tl.load(xs_ptr + 2 * b32, mask=smask2, other=0.0)
        xs_lo += tl.load(xs_ptr + 2 * b32 + 1, mask=smask2, other=0.0)
        xs_hi = tl.load(xs_ptr + 2 * b32 + 2, mask=smask2, other=0.0)
        xs_hi += tl.load(xs_ptr + 2 * b32 + 3, mask=smask2, other=0.0)
        part = (d * sc_lo) * (xd_lo * i_lo.to(tl.float32)) - (dmin * m_lo) * xs_lo
        part += (d * sc_hi) * (xd_hi * i_hi.to(tl.float32)) - (dmin * m_hi) * xs_hi
        acc += tl.sum(part, axis=1)
    return acc


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
            if k % 2 == 0:  # noqa: SIM108 (a static branch, which Triton compiles away)
                low = qa
            else:
                low = qb
            if k < 2:  # noqa: SIM108
                low = low & 0x0F0F0F0F
            else:
                low = (low >> 4) & 0x0F0F0F0F
            q = low | (((qh >> (2 * k)) & 0x03030303) << 4)
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
        acc = _q45_k_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N, SBS, False, ASM)
    elif QTYPE == Q5_K:
        acc = _q45_k_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N, SBS, True, ASM)
    elif QTYPE == Q6_K:
        acc = _q6_k_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N, SBS, ASM)
    else:
        acc = _q8_0_rows_dot_q8(row_at, row_mask, x8_ptr, K, BLOCK_N, ASM)
    return acc


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
