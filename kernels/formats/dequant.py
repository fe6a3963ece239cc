"""Dequantization of split-Q4_0 matrices, many at once: prefill's expert weights.

Layout (`kernels.experts.moe.split_q4_0`): a matrix [rows, cols] with cols % 32 == 0 has nb = cols /
32 Q4_0 blocks per row and takes rows * nb * 18 bytes,

    bytes [0, rows*nb*2)              fp16 scales d, row-major [rows, nb]
    bytes [rows*nb*2, rows*nb*18)     nibbles, [rows, nb, 16]

Byte j of a block holds value j in its low nibble and value j + 16 in its high nibble, and
value = d * (nibble - 8): column b*32 + j of row r is d[r, b] * ((byte[r, b, j] & 0xF) - 8),
column b*32 + 16 + j is d[r, b] * ((byte[r, b, j] >> 4) - 8). The product is computed in
float32 (exact: an fp16 times a 4-bit integer) and rounded once to the output dtype, so the
result is bit-identical to GGUF's dequantization followed by `.to(dtype)`.

`_dequant_kernel` takes n such matrices, one per row of a uint8 tensor [n, nbytes] (which may be a
column slice of a wider buffer, e.g. one projection of every expert blob), and writes [n, rows,
cols]. Its grid is (matrix, block of BLOCK_R rows); each program loops over the row's blocks BLOCK_B
at a time. Where the nibble area is 4-byte aligned (always for the engine's layouts: see
`kernels.experts.moe.split_q4_0_ok`) the nibbles are read as 32-bit words, four per block, and
unpacked in registers: byte i of word w is value 4w + i (low nibble) and 4w + i + 16 (high nibble).
The unpacked values are assembled (`tl.join`, in the order of the output columns) into tiles of
whole blocks, BLOCK_B blocks of 32 contiguous columns per row, stored contiguously. Otherwise every
byte is loaded on its own (scales as two bytes), which is correct at any alignment. A bfloat16
output is rounded to nearest even with integer operations (`_to_bf16`): the same bits on a GPU and
in Triton's interpreter, whose own float32
-> bfloat16 cast truncates.

Three tiers as everywhere in kernels/: `_dequant_kernel` (Triton), `dequant_q4_0_split`
(launcher: checks inputs, picks the load width, builds the grid) and
`dequant_q4_0_split_ref` (the torch reference).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

Q4_0_BLOCK, Q4_0_BYTES = 32, 18
DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DequantConfig:
    """Launch settings."""

    block_r: int = 16  # matrix rows per program
    block_b: int = 8  # Q4_0 blocks (of 32 columns) per loop step
    num_warps: int = 4


# --- Triton ------------------------------------------------------------------------------


@triton.jit
def _to_bf16(x):
    """float32 -> bfloat16 rounded to nearest even, NaN as 0x7FC0: torch's conversion, done
    in integers so that Triton's interpreter (which truncates) agrees with the GPU."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_kernel(
    src_ptr,  # uint8: matrix m starts at src_ptr + m * stride_m
    out_ptr,  # [n, rows, cols] contiguous, the output dtype
    rows,
    nb,  # Q4_0 blocks per row (cols / 32)
    stride_m,  # bytes between two matrices
    nib_off,  # rows * nb * 2: where the nibbles start within a matrix
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    WORDS: tl.constexpr,  # nibbles 4-byte aligned: read them as int32 words
    BF16: tl.constexpr,  # the output is bfloat16
):
    m = tl.program_id(0).to(tl.int64)
    base = src_ptr + m * stride_m
    cols = nb * 32
    out = out_ptr + m * rows * cols

    # One (row, block) pair per index of a flat tile of BLOCK_R * BLOCK_B blocks.
    idx = tl.arange(0, BLOCK_R * BLOCK_B)
    r = tl.program_id(1) * BLOCK_R + idx // BLOCK_B
    r64 = r.to(tl.int64)
    c = tl.arange(0, 32)  # column within a block
    half = tl.arange(0, 2)  # 0: low nibbles (values 0..15), 1: high nibbles (16..31)
    for b0 in range(0, nb, BLOCK_B):
        blk = b0 + idx % BLOCK_B
        mask = (r < rows) & (blk < nb)  # [M]
        at = r64 * nb + blk  # block index within the matrix
        if WORDS:
            d = tl.load(base.to(tl.pointer_type(tl.float16)) + at, mask=mask, other=0.0)
            words = (base + nib_off).to(tl.pointer_type(tl.int32))
            w = tl.arange(0, 4)  # word w of a block: bytes 4w..4w+3
            q = tl.load(words + at[:, None] * 4 + w[None, :], mask=mask[:, None], other=0)
            # [M, 2 (half), 4 (word)]: the word shifted to its low or high nibbles
            qh = q[:, None, :] >> (4 * half)[None, :, None]
            n0 = qh & 0xF  # byte 0 of each word
            n1 = (qh >> 8) & 0xF
            n2 = (qh >> 16) & 0xF
            n3 = (qh >> 24) & 0xF
            # [M, 2, 4, 2, 2] with byte i = 2 * (second-to-last) + last: value half*16 + 4w + i
            nib = tl.join(tl.join(n0, n2), tl.join(n1, n3))
            nib = tl.reshape(nib, [BLOCK_R * BLOCK_B, 32])
        else:
            lo = tl.load(base + at * 2, mask=mask, other=0).to(tl.uint16)
            hi = tl.load(base + at * 2 + 1, mask=mask, other=0).to(tl.uint16)
            d = (lo | (hi << 8)).to(tl.float16, bitcast=True)
            j = tl.arange(0, 16)
            byte = tl.load(base + nib_off + at[:, None] * 16 + j[None, :], mask=mask[:, None])
            nib = (byte.to(tl.int32)[:, None, :] >> (4 * half)[None, :, None]) & 0xF
            nib = tl.reshape(nib, [BLOCK_R * BLOCK_B, 32])  # [M, 2 (half), 16]
        val = d.to(tl.float32)[:, None] * (nib - 8).to(tl.float32)  # exact
        dst = out + r64[:, None] * cols + blk[:, None] * 32 + c[None, :]
        if BF16:
            tl.store(dst, _to_bf16(val), mask=mask[:, None])
        else:
            tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=mask[:, None])


# --- launcher ----------------------------------------------------------------------------


def nibble_words(sections: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether every matrix's nibbles in `sections` [n, bytes] start 4-byte aligned, so that
    `dequant_q4_0_split` reads them as 32-bit words (else byte by byte)."""
    nib_off = rows * (cols // Q4_0_BLOCK) * 2
    stride_m = sections.stride(0) if sections.shape[0] > 1 else 0
    return (sections.data_ptr() + nib_off) % 4 == 0 and stride_m % 4 == 0


def dequant_q4_0_split(
    sections: torch.Tensor,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    config: DequantConfig | None = None,
) -> torch.Tensor:
    """sections uint8 [n, rows*cols/32*18], each row one split-Q4_0 matrix [rows, cols]
    (rows may be strided, bytes within a row contiguous) -> [n, rows, cols] in `dtype`,
    bit-exact with `dequant_q4_0_split_ref(...).to(dtype)`. `out` (contiguous
    [n, rows, cols] of `dtype` on the same device) is written and returned if given."""
    if sections.dtype != torch.uint8:
        raise ValueError(f"sections must be uint8 bytes, got {sections.dtype}")
    if sections.dim() != 2:
        raise ValueError(f"sections must be 2-D [n, bytes], got shape {tuple(sections.shape)}")
    if rows <= 0 or cols <= 0 or cols % Q4_0_BLOCK:
        raise ValueError(
            f"a Q4_0 matrix needs rows > 0 and cols a positive multiple of 32, got [{rows}, {cols}]"
        )
    nb = cols // Q4_0_BLOCK
    n, nbytes = sections.shape
    if nbytes != rows * nb * Q4_0_BYTES:
        raise ValueError(
            f"a split-Q4_0 [{rows}, {cols}] matrix takes {rows * nb * Q4_0_BYTES} bytes,"
            f" sections have {nbytes} per row"
        )
    if sections.stride(1) != 1:
        raise ValueError(
            f"the bytes of each matrix must be contiguous (last-dim stride 1),"
            f" got strides {sections.stride()}"
        )
    if dtype not in DEQUANT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    shape = (n, rows, cols)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=sections.device)
    else:
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(
                f"out must be {dtype} {list(shape)}, got {out.dtype} {list(out.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if out.device != sections.device:
            raise ValueError(f"out on {out.device} but sections on {sections.device}")
    if n == 0:
        return out
    cfg = config or DequantConfig()
    nib_off = rows * nb * 2
    stride_m = sections.stride(0) if n > 1 else 0
    words = nibble_words(sections, rows, cols)
    block_r = min(cfg.block_r, triton.next_power_of_2(rows))
    block_b = min(cfg.block_b, triton.next_power_of_2(nb))
    grid = (n, triton.cdiv(rows, block_r))
    with torch.cuda.device(sections.device) if sections.is_cuda else nullcontext():
        _dequant_kernel[grid](
            sections, out, rows, nb, stride_m, nib_off,
            BLOCK_R=block_r, BLOCK_B=block_b, WORDS=words, BF16=dtype == torch.bfloat16,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return out


# --- reference ---------------------------------------------------------------------------


def dequant_q4_0_split_ref(sections: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Float32 [n, rows, cols] from n split-Q4_0 matrices [n, bytes] (bit-exact with the
    GGUF dequantization of the same blocks: d * (q - 8))."""
    n, nb = sections.shape[0], cols // Q4_0_BLOCK
    scales = sections[:, : rows * nb * 2].contiguous().view(torch.float16).view(n, rows, nb)
    nib = sections[:, rows * nb * 2 :].reshape(n, rows, nb, 16).to(torch.int16)
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1) - 8  # [n, rows, nb, 32]
    return (scales.float()[..., None] * q.float()).view(n, rows, cols)
