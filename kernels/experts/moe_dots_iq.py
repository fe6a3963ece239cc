"""Row dots of the fused MoE kernels for the i-quants (`kernels.experts.moe_dots.blocks_rows_dot`
calls them; the same contract: rows of one projection at byte address `w_ptr`, ROW_BYTES
per row, dot x [K] -> [BLOCK_N] float32, a 256-value super-block per step).

- IQ4_XS (aligned): the codes as 32-bit words, a table lookup per weight, the scale once per
  32 values.
- IQ3_S: a super-block as [32-value block, grid point, 4]: one code, sign byte and table
  lookup per grid point of 4 weights, the block's scale once.
- IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S (`_grid_rows_dot`): a super-block as
  `kernels.formats.iq_decode.grid_block` decodes it, [32-value block, grid point, value]: one grid
  lookup per point (its 4 or 8 values as one 32- or 64-bit word of the table), one sign byte
  per point, the scale once per point's dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.formats.byte_loads import _load_f16
from kernels.formats.iq_decode import (
    GRID_BITS,
    IQ3_S_GRID,
    IQ4_VALUES,
    grid_block,
    grid_block_bytes,
    grid_width,
)


@triton.jit
def _iq4_xs_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, BLOCK_N: tl.constexpr):
    """IQ4_XS (136 bytes: d | scales_h u16 | scales_l 4 | codes 128), rows and blocks aligned:
    the codes as 32-bit words [block of 32 values, word]: byte b of word w of block ib holds
    value 32 ib + 4w + b (low nibble) and 32 ib + 16 + 4w + b (high), each a level of the
    IQ4 table; the block's scale d (ls - 32) once per block."""
    rows64 = rows.to(tl.int64)[:, None, None]
    ib = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    word = tl.arange(0, 4)[None, None, :]  # [1, 1, 4]
    mask3 = row_mask[:, None, None]
    ib2 = tl.arange(0, 8)[None, :]  # [1, 8]
    hmask = row_mask[:, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = w_ptr + rows64 * ROW_BYTES + sb * 136
        q = tl.load((blk + 8 + ib * 16 + word * 4).to(tl.pointer_type(tl.int32)), mask=mask3,
                    other=0)  # fmt: skip  # [BN, 8, 4]
        xb = x_ptr + sb * 256 + ib * 32 + word * 4  # [1, 8, 4]
        dot = tl.zeros([BLOCK_N, 8, 4], dtype=tl.float32)
        for b in tl.static_range(4):
            lo = tl.load(tab_ptr + IQ4_VALUES + ((q >> (8 * b)) & 0xF), mask=mask3, other=0)
            hi = tl.load(tab_ptr + IQ4_VALUES + ((q >> (8 * b + 4)) & 0xF), mask=mask3, other=0)
            x_lo = tl.load(xb + b).to(tl.float32)
            x_hi = tl.load(xb + 16 + b).to(tl.float32)
            dot += lo.to(tl.int8, bitcast=True).to(tl.float32) * x_lo
            dot += hi.to(tl.int8, bitcast=True).to(tl.float32) * x_hi
        head = w_ptr + rows.to(tl.int64)[:, None] * ROW_BYTES + sb * 136  # [BN, 1]
        low = (tl.load(head + 4 + ib2 // 2, mask=hmask, other=0).to(tl.int32) >> (4 * (ib2 % 2)))
        high = tl.load(head + 2 + ib2 // 4, mask=hmask, other=0).to(tl.int32) >> (2 * (ib2 % 4))
        ls = ((low & 0xF) | ((high & 3) << 4)) - 32  # [BN, 8]
        dl = _load_f16(head, hmask) * ls.to(tl.float32)
        acc += tl.sum(dl * tl.sum(dot, axis=2), axis=1)
    return acc


@triton.jit
def _iq3_s_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, BLOCK_N: tl.constexpr):
    """IQ3_S (110 bytes: d | qs 64 | qh 8 | signs 32 | scales 4). Value 32b + 4p + j is byte
    j of grid point qs[8b + p] | (bit p of qh[b]) << 8, negated by bit 4(p % 2) + j of
    signs[4b + p // 2], times d (1 + 2 scale_b). The tile is [BN, b, p, j]."""
    b = tl.arange(0, 8)[None, :, None, None]
    p = tl.arange(0, 8)[None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, :]
    mask4 = row_mask[:, None, None, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = w_ptr + rows.to(tl.int64)[:, None, None, None] * ROW_BYTES + sb * 110
        code = tl.load(blk + 2 + 8 * b + p, mask=mask4, other=0).to(tl.int32)  # [BN, 8, 8, 1]
        ninth = (tl.load(blk + 66 + b, mask=mask4, other=0).to(tl.int32) >> p) & 1
        grid = tl.load(tab_ptr + IQ3_S_GRID + (code | (ninth << 8)) * 4 + j, mask=mask4,
                       other=0).to(tl.float32)  # fmt: skip
        sign = tl.load(blk + 74 + 4 * b + p // 2, mask=mask4, other=0).to(tl.int32)
        x = tl.load(x_ptr + sb * 256 + 32 * b + 4 * p + j).to(tl.float32)  # [1, 8, 8, 4]
        gx = tl.where(((sign >> (4 * (p % 2) + j)) & 1) == 1, -grid, grid) * x
        dot = tl.sum(tl.sum(gx, axis=3), axis=2)  # [BN, 8]
        b2 = tl.arange(0, 8)[None, :]
        head = w_ptr + rows.to(tl.int64)[:, None] * ROW_BYTES + sb * 110  # [BN, 1]
        sc = tl.load(head + 106 + b2 // 2, mask=row_mask[:, None], other=0).to(tl.int32)
        sc = (sc >> (4 * (b2 % 2))) & 0xF
        db = _load_f16(head, row_mask[:, None]) * (1 + 2 * sc).to(tl.float32)  # [BN, 8]
        acc += tl.sum(db * dot, axis=1)
    return acc


@triton.jit
def _grid_rows_dot(w_ptr, rows, row_mask, x_ptr, K, ROW_BYTES, tab_ptr, QTYPE: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S: a super-block per step as `grid_block`'s tile
    [BN, 32-value block, grid point, value], each point's dot scaled once."""
    tl.static_assert((GRID_BITS >> QTYPE) % 2 == 1, "_grid_rows_dot reads the grid types")
    WIDTH: tl.constexpr = grid_width(QTYPE)
    BYTES: tl.constexpr = grid_block_bytes(QTYPE)
    b = tl.arange(0, 8)[None, :, None, None]
    p = tl.arange(0, 32 // WIDTH)[None, None, :, None]
    j = tl.arange(0, WIDTH)[None, None, None, :]
    mask4 = row_mask[:, None, None, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sb in range(0, K // 256):
        blk = w_ptr + rows.to(tl.int64)[:, None, None, None] * ROW_BYTES + sb * BYTES
        g, scale = grid_block(blk, b, p, j, mask4, tab_ptr, QTYPE)
        x = tl.load(x_ptr + sb * 256 + 32 * b + WIDTH * p + j).to(tl.float32)  # [1, 8, P, W]
        dot = tl.sum(g * x, axis=3, keep_dims=True) * scale  # [BN, 8, P, 1]
        acc += tl.sum(tl.sum(tl.sum(dot, axis=3), axis=2), axis=1)
    return acc
