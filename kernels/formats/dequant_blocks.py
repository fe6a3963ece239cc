"""Dequantization of many matrices of GGUF blocks at once: prefill's expert weights of the
types the engine keeps as blocks (everything but Q4_0, which it keeps split:
`kernels.formats.dequant`).

`sections` [n, bytes] holds one matrix [rows, cols] of GGUF blocks per row (which may be a
column slice of a wider buffer, e.g. one projection of every expert blob); the result is
[n, rows, cols] in float32, bfloat16 or float16. Q4_K, Q6_K, Q8_0, MXFP4, IQ3_S and the low-bit
grid i-quants (IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S: `kernels.formats.iq_decode.grid_block`) are
decoded a block at a time (each scale loaded once per sub-block, the tile stored in the
blocks' own shape); the other types value by value by the GEMV kernel's tile decoder
(`kernels.layers.gemv._dequant_tile`). Both follow llama.cpp's formulas in float32, and each value
is rounded once to the output dtype (bfloat16 to nearest even in integers, so Triton's
interpreter agrees with the GPU): bit-identical to
`kernels.formats.quant.dequantize(...).to(dtype)`.

Three tiers: `_blocks_kernel` (Triton, grid (matrix, row block, column block)),
`dequant_blocks` (the launcher) and `dequant_blocks_ref` (the torch reference).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.formats import iq_tables
from kernels.formats.byte_loads import _load_e8m0_half, _load_f16, _load_u8
from kernels.formats.dequant import DEQUANT_DTYPES, _to_bf16
from kernels.formats.iq_decode import (
    GRID_BITS,
    GRID_QTYPES,
    _e2m1_doubled,
    grid_block,
    grid_block_bytes,
    grid_width,
)
from kernels.formats.iq_tables import iq_tables as tables_on
from kernels.formats.quant import QType, dequantize, row_bytes
from kernels.layers.gemv import GEMV_QTYPES, _dequant_tile, _k_scale_min

Q4_K: tl.constexpr = tl.constexpr(int(QType.Q4_K))
Q6_K: tl.constexpr = tl.constexpr(int(QType.Q6_K))
Q8_0: tl.constexpr = tl.constexpr(int(QType.Q8_0))
MXFP4: tl.constexpr = tl.constexpr(int(QType.MXFP4))
IQ3_S: tl.constexpr = tl.constexpr(int(QType.IQ3_S))
IQ3_S_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ3_S_GRID)
# the types decoded a block at a time, 256 columns per program
TILED = frozenset({QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.MXFP4, QType.IQ3_S}) | GRID_QTYPES


@dataclass(frozen=True)
class BlocksConfig:
    """Launch settings."""

    block_r: int = 16  # matrix rows per program
    block_c: int = 256  # columns per program
    num_warps: int = 4


@triton.jit
def _blocks_kernel(
    src_ptr,  # uint8: matrix m starts at src_ptr + m * stride_m
    out_ptr,  # [n, rows, cols] contiguous
    rows,
    cols,
    row_bytes,
    stride_m,
    tab_ptr,  # the i-quants' tables (kernels.formats.iq_tables)
    QTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BF16: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(2) * BLOCK_C  # BLOCK_C == 256 for the block-shaped tiles
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    src = src_ptr + m * stride_m
    out = out_ptr + m * rows * cols
    if QTYPE == Q4_K:  # [BR, sub-block 8, 32]: scale and min once per sub-block
        r3 = r[:, None, None]
        sub = tl.arange(0, 8)[None, :, None]
        j = tl.arange(0, 32)[None, None, :]
        mask = r3 < rows
        blk = src + r3.to(tl.int64) * row_bytes + (c0 // 256) * 144
        q = (_load_u8(blk + 16 + (sub // 2) * 32 + j, mask) >> ((sub % 2) * 4)) & 0xF
        sc, mn = _k_scale_min(blk + 4, sub, mask)
        w = (_load_f16(blk, mask) * sc) * q.to(tl.float32) - _load_f16(blk + 2, mask) * mn
        dst = out + r3.to(tl.int64) * cols + c0 + sub * 32 + j
    elif QTYPE == Q6_K:  # [BR, half 2, k 4, 32]: value 128 half + 32 k + l
        r4 = r[:, None, None, None]
        n = tl.arange(0, 2)[None, :, None, None]
        k = tl.arange(0, 4)[None, None, :, None]
        lane = tl.arange(0, 32)[None, None, None, :]
        mask = r4 < rows
        blk = src + r4.to(tl.int64) * row_bytes + (c0 // 256) * 210
        ql = (_load_u8(blk + 64 * n + 32 * (k % 2) + lane, mask) >> (4 * (k // 2))) & 0xF
        qh = (_load_u8(blk + 128 + 32 * n + lane, mask) >> (2 * k)) & 3
        sc = tl.load(blk + 192 + 8 * n + 2 * k + lane // 16, mask=mask, other=0)
        d = _load_f16(blk + 208, mask)
        q = ((ql | (qh << 4)) - 32).to(tl.float32)
        w = (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * q
        dst = out + r4.to(tl.int64) * cols + c0 + 128 * n + 32 * k + lane
    elif QTYPE == Q8_0:  # [BR, block 8, 32]: one scale per block
        r3 = r[:, None, None]
        b = tl.arange(0, 8)[None, :, None]
        j = tl.arange(0, 32)[None, None, :]
        mask = (r3 < rows) & (c0 + b * 32 < cols)
        blk = src + r3.to(tl.int64) * row_bytes + (c0 // 32 + b) * 34
        q = tl.load(blk + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _load_f16(blk, mask)
        dst = out + r3.to(tl.int64) * cols + c0 + b * 32 + j
    elif QTYPE == MXFP4:  # [BR, block 8, half 2, 16]: value 32 b + 16 h + j, one exponent a block
        r4 = r[:, None, None, None]
        b = tl.arange(0, 8)[None, :, None, None]
        h = tl.arange(0, 2)[None, None, :, None]
        j = tl.arange(0, 16)[None, None, None, :]
        mask = (r4 < rows) & (c0 + b * 32 < cols)
        blk = src + r4.to(tl.int64) * row_bytes + (c0 // 32 + b) * 17
        q = (_load_u8(blk + 1 + j, mask) >> (4 * h)) & 0xF
        w = _load_e8m0_half(blk, mask) * _e2m1_doubled(q)
        dst = out + r4.to(tl.int64) * cols + c0 + 32 * b + 16 * h + j
    elif QTYPE == IQ3_S:  # [BR, block 8, grid point 8, 4]: one code and sign byte per point
        r4 = r[:, None, None, None]
        b = tl.arange(0, 8)[None, :, None, None]
        p = tl.arange(0, 8)[None, None, :, None]
        j = tl.arange(0, 4)[None, None, None, :]
        mask = r4 < rows
        blk = src + r4.to(tl.int64) * row_bytes + (c0 // 256) * 110
        ninth = (_load_u8(blk + 66 + b, mask) >> p) & 1
        code = _load_u8(blk + 2 + 8 * b + p, mask) | (ninth << 8)
        grid = tl.load(tab_ptr + IQ3_S_GRID + code * 4 + j, mask=mask, other=0).to(tl.float32)
        sc = (_load_u8(blk + 106 + b // 2, mask) >> ((b % 2) * 4)) & 0xF
        w = (_load_f16(blk, mask) * (1 + 2 * sc).to(tl.float32)) * grid
        sign = (_load_u8(blk + 74 + 4 * b + p // 2, mask) >> (4 * (p % 2) + j)) & 1
        w = tl.where(sign == 1, -w, w)
        dst = out + r4.to(tl.int64) * cols + c0 + 32 * b + 4 * p + j
    elif (GRID_BITS >> QTYPE) & 1:  # [BR, block 8, grid point, value]: a table word per point
        WIDTH: tl.constexpr = grid_width(QTYPE)
        r4 = r[:, None, None, None]
        b = tl.arange(0, 8)[None, :, None, None]
        p = tl.arange(0, 32 // WIDTH)[None, None, :, None]
        j = tl.arange(0, WIDTH)[None, None, None, :]
        mask = r4 < rows
        blk = src + r4.to(tl.int64) * row_bytes + (c0 // 256) * grid_block_bytes(QTYPE)
        g, scale = grid_block(blk, b, p, j, mask, tab_ptr, QTYPE)
        w = scale * g
        dst = out + r4.to(tl.int64) * cols + c0 + 32 * b + WIDTH * p + j
    else:  # value by value
        r2 = r[:, None]
        c = c0 + tl.arange(0, BLOCK_C)[None, :]  # [1, BC]
        mask = (r2 < rows) & (c < cols)
        row_ptr = src + r2.to(tl.int64) * row_bytes
        w = _dequant_tile(row_ptr, c, mask, tab_ptr, QTYPE)  # [BR, BC] float32
        dst = out + r2.to(tl.int64) * cols + c
    if BF16:
        tl.store(dst, _to_bf16(w), mask=mask)
    else:
        tl.store(dst, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_blocks(
    sections: torch.Tensor,
    qtype: QType,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    config: BlocksConfig = BlocksConfig(),
) -> torch.Tensor:
    """sections uint8 [n, rows * row_bytes] (rows may be strided, bytes within a row
    contiguous) of GGUF blocks of `qtype` -> [n, rows, cols] in `dtype`."""
    if qtype not in GEMV_QTYPES:
        raise ValueError(f"no block decoder for {qtype.name}")
    if sections.dtype != torch.uint8 or sections.dim() != 2 or sections.stride(1) != 1:
        raise ValueError("sections must be uint8 [n, bytes] with contiguous rows")
    nbytes = row_bytes(qtype, cols)  # raises where the blocks do not divide cols
    if sections.shape[1] != rows * nbytes:
        raise ValueError(
            f"{qtype.name} [{rows}, {cols}] takes {rows * nbytes} bytes, got {sections.shape[1]}"
        )
    if dtype not in DEQUANT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    n = sections.shape[0]
    out = torch.empty((n, rows, cols), dtype=dtype, device=sections.device)
    if n == 0:
        return out
    block_c = 256 if qtype in TILED else config.block_c
    grid = (n, triton.cdiv(rows, config.block_r), triton.cdiv(cols, block_c))
    with torch.cuda.device(sections.device) if sections.is_cuda else nullcontext():
        _blocks_kernel[grid](
            sections, out, rows, cols, nbytes, sections.stride(0) if n > 1 else 0,
            tables_on(sections.device),
            QTYPE=int(qtype), BLOCK_R=config.block_r, BLOCK_C=block_c,
            BF16=dtype == torch.bfloat16, num_warps=config.num_warps,
        )  # fmt: skip
    return out


def dequant_blocks_ref(sections: torch.Tensor, qtype: QType, rows: int, cols: int) -> torch.Tensor:
    """Float32 [n, rows, cols]: the GGUF dequantization, in torch."""
    return dequantize(sections.contiguous(), qtype, (sections.shape[0], rows, cols))
