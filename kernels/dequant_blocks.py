"""Dequantization of many matrices of GGUF blocks at once: prefill's expert weights of the
types the engine keeps as blocks (everything but Q4_0, which it keeps split: `kernels.dequant`).

`sections` [n, bytes] holds one matrix [rows, cols] of GGUF blocks per row (which may be a
column slice of a wider buffer, e.g. one projection of every expert blob); the result is
[n, rows, cols] in float32, bfloat16 or float16. Each value is decoded in registers by the
GEMV kernel's tile decoder (`kernels.gemv._dequant_tile`, llama.cpp's formulas in float32)
and rounded once to the output dtype (bfloat16 to nearest even in integers, so Triton's
interpreter agrees with the GPU): bit-identical to `kernels.quant.dequantize(...).to(dtype)`.

Three tiers: `_blocks_kernel` (Triton, grid (matrix, row block, column block)),
`dequant_blocks` (the launcher) and `dequant_blocks_ref` (the torch reference).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dequant import DEQUANT_DTYPES, _to_bf16
from kernels.gemv import GEMV_QTYPES, _dequant_tile
from kernels.iq_tables import iq_tables
from kernels.quant import QType, dequantize, row_bytes


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
    tab_ptr,  # the i-quants' tables (kernels.iq_tables)
    QTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BF16: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # [BR, 1]
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BC]
    mask = (r < rows) & (c < cols)
    row_ptr = src_ptr + m * stride_m + r.to(tl.int64) * row_bytes
    w = _dequant_tile(row_ptr, c, mask, tab_ptr, QTYPE)  # [BR, BC] float32
    dst = out_ptr + m * rows * cols + r.to(tl.int64) * cols + c
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
    grid = (n, triton.cdiv(rows, config.block_r), triton.cdiv(cols, config.block_c))
    with torch.cuda.device(sections.device) if sections.is_cuda else nullcontext():
        _blocks_kernel[grid](
            sections, out, rows, cols, nbytes, sections.stride(0) if n > 1 else 0,
            iq_tables(sections.device),
            QTYPE=int(qtype), BLOCK_R=config.block_r, BLOCK_C=config.block_c,
            BF16=dtype == torch.bfloat16, num_warps=config.num_warps,
        )  # fmt: skip
    return out


def dequant_blocks_ref(sections: torch.Tensor, qtype: QType, rows: int, cols: int) -> torch.Tensor:
    """Float32 [n, rows, cols]: the GGUF dequantization, in torch."""
    return dequantize(sections.contiguous(), qtype, (sections.shape[0], rows, cols))
