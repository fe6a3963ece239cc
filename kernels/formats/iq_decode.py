"""The i-quants (and MXFP4: levels from its E2M1 bits, scales from E8M0 bytes) in Triton, two ways:

- `dequant_iq`, value by value: the tile decoder's share (`kernels.layers.gemv._dequant_tile`) for
  IQ4_NL, MXFP4, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S and IQ1_S, which the GEMV kernel,
  the fused MoE kernels' fallback row dot and the prefill dequantization call. Each element
  locates its own block, grid point, sign bit and scale, so a tile need not align with blocks.
- `grid_block`, a super-block at a time for the low-bit grid types (`GRID_QTYPES`: IQ3_XXS,
  IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S), as [32-value block, grid point, value]: one table word per grid
  point (its 4 or 8 values), one sign byte and scale per point. The MoE row dot
  (`kernels.experts.moe_dots_iq`) and the prefill dequantization (`kernels.formats.dequant_blocks`)
  use it.

The grids and the sign table are read from the one table buffer (`kernels.formats.iq_tables`, at
`tab_ptr`). The arithmetic is llama.cpp's, in the order the torch references use
(`kernels.formats.quant_iq`), so each value is bit-identical to theirs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.formats import iq_tables
from kernels.formats.byte_loads import _load_e8m0_half, _load_f16, _load_u8, _load_u16, _load_u32
from kernels.formats.int_float import _small_to_f32
from kernels.formats.quant import QType, block_geometry

IQ4_NL: tl.constexpr = tl.constexpr(int(QType.IQ4_NL))
MXFP4: tl.constexpr = tl.constexpr(int(QType.MXFP4))
IQ4_XS: tl.constexpr = tl.constexpr(int(QType.IQ4_XS))
IQ3_S: tl.constexpr = tl.constexpr(int(QType.IQ3_S))
IQ3_XXS: tl.constexpr = tl.constexpr(int(QType.IQ3_XXS))
IQ2_XXS: tl.constexpr = tl.constexpr(int(QType.IQ2_XXS))
IQ2_XS: tl.constexpr = tl.constexpr(int(QType.IQ2_XS))
IQ2_S: tl.constexpr = tl.constexpr(int(QType.IQ2_S))
IQ1_S: tl.constexpr = tl.constexpr(int(QType.IQ1_S))
IQ3_S_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ3_S_GRID)
IQ4_VALUES: tl.constexpr = tl.constexpr(iq_tables.IQ4_VALUES)
IQ3_XXS_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ3_XXS_GRID)
IQ2_XXS_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ2_XXS_GRID)
IQ2_XS_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ2_XS_GRID)
IQ2_S_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ2_S_GRID)
IQ1_S_GRID: tl.constexpr = tl.constexpr(iq_tables.IQ1_S_GRID)
KSIGNS: tl.constexpr = tl.constexpr(iq_tables.KSIGNS)
IQ1S_DELTA: tl.constexpr = tl.constexpr(0.125)  # llama.cpp's IQ1S_DELTA
# the low-bit grid types `grid_block` reads, and the same as bits 1 << type (Triton has no `in`)
GRID_QTYPES: frozenset[QType] = frozenset(
    {QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S}
)
GRID_BITS: tl.constexpr = tl.constexpr(sum(1 << int(q) for q in GRID_QTYPES))
IQ_QTYPES: frozenset[QType] = (
    frozenset({QType.IQ4_NL, QType.MXFP4, QType.IQ4_XS, QType.IQ3_S}) | GRID_QTYPES
)
# (values per grid point, bytes per block) of each grid type
_GRID_SHAPES = {int(q): (4 if q == QType.IQ3_XXS else 8, block_geometry(q)[1]) for q in GRID_QTYPES}


@triton.constexpr_function
def grid_width(qtype: int) -> int:
    """The values per grid point of grid type `qtype`: 4 for IQ3_XXS, else 8."""
    return _GRID_SHAPES[qtype][0]


@triton.constexpr_function
def grid_block_bytes(qtype: int) -> int:
    return _GRID_SHAPES[qtype][1]


@triton.jit
def _level(tab_ptr, q, mask, TABLE: tl.constexpr):
    """The level (float32) of 4-bit codes q in the 16-entry int8 table at TABLE (IQ4_VALUES)."""
    level = tl.load(tab_ptr + TABLE + q, mask=mask, other=0).to(tl.int8, bitcast=True)
    return level.to(tl.float32)


# MXFP4's doubled magnitudes 0, 1, 2, 3, 4, 6, 8, 12 of codes 0..7, a nibble each (code k at
# bits 4k..4k + 3) of 0xC8643210, as an int32 (an arithmetic shift leaves those bits as they are)
E2M1_NIBBLES: tl.constexpr = tl.constexpr(0xC8643210 - (1 << 32))


@triton.jit
def _e2m1_doubled(q):
    """MXFP4's level (float32) of 4-bit E2M1 codes q, doubled as llama.cpp's kvalues_mxfp4:
    0, 1, 2, 3, 4, 6, 8, 12 for codes 0..7 and their negatives for 8..15, from a constant's
    nibbles and the sign bit (bit 3), with no table load and no int-to-float conversion
    (`kernels.formats.int_float`); code 8, E2M1's -0, is +0 as there."""
    q = q.to(tl.int32)
    nibbles = tl.zeros_like(q) + E2M1_NIBBLES  # (a constant splat: the shift is per element)
    mag = _small_to_f32((nibbles >> ((q & 7) << 2)) & 0xF, 0)
    # the sign where the code is negative and not zero: bit 31 of -(q & 7) is set for 1..7
    sign = ((q & 8) << 28) & (0 - (q & 7))
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _signed(w, tab_ptr, sign_index, bit, mask):
    """w negated where bit `bit` (0..7) of the 8 signs that 7-bit `sign_index` stands for
    (llama.cpp's ksigns_iq2xs) is set."""
    signs = _load_u8(tab_ptr + KSIGNS + sign_index, mask)
    return tl.where(((signs >> bit) & 1) == 1, -w, w)


@triton.jit
def _xxs_value(blk, i, mask, tab_ptr, GRID: tl.constexpr, WIDTH: tl.constexpr,
               AUX_AT: tl.constexpr, AUX_STRIDE: tl.constexpr, MULT: tl.constexpr):  # fmt: skip
    """IQ3_XXS (WIDTH 4) and IQ2_XXS (8): value i (0..255) of the block at `blk`. Its 32-value
    group b has grid indices at byte 2 + 8b (one per WIDTH values) and a uint32 at
    AUX_AT + AUX_STRIDE b: 4 x 7-bit sign indices (one per 8 values), then a 4-bit scale s;
    the value is d (0.5 + s) MULT times the grid's byte, signed."""
    b = i // 32
    r = i % 32
    code = _load_u8(blk + 2 + 8 * b + r // WIDTH, mask)
    g = _load_u8(tab_ptr + GRID + code * WIDTH + r % WIDTH, mask).to(tl.float32)
    aux = blk + AUX_AT + AUX_STRIDE * b
    at = 7 * (r // 8)  # the sign index's first bit
    sign_index = (_load_u16(aux + at // 8, mask) >> (at % 8)) & 127
    s = (_load_u8(aux + 3, mask) >> 4).to(tl.float32)
    w = ((_load_f16(blk, mask) * (0.5 + s)) * MULT) * g
    return _signed(w, tab_ptr, sign_index, r % 8, mask)


@triton.jit
def _iq2_scale(at, i, mask):
    """IQ2_XS / IQ2_S: d's factor (0.5 + s) for value i, s the 4-bit scale of its 16 values
    (bytes at `at`, low nibble first)."""
    s = (_load_u8(at + i // 32, mask) >> (4 * ((i // 16) % 2))) & 0xF
    return 0.5 + s.to(tl.float32)


@triton.jit
def dequant_iq(row_ptr, ks, mask, tab_ptr, QTYPE: tl.constexpr):
    """Float32 weights of i-quant QTYPE for byte pointers to row starts `row_ptr` and
    columns `ks` (as `kernels.layers.gemv._dequant_tile`)."""
    if QTYPE == IQ4_NL:  # d | 16 bytes of 4-bit codes, laid out as Q4_0's
        blk = row_ptr + (ks // 32) * 18
        j = ks % 32
        q = (_load_u8(blk + 2 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = _load_f16(blk, mask) * _level(tab_ptr, q, mask, IQ4_VALUES)
    elif QTYPE == MXFP4:  # e (E8M0) | 16 bytes of 4-bit codes, as IQ4_NL's
        blk = row_ptr + (ks // 32) * 17
        j = ks % 32
        q = (_load_u8(blk + 1 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = _load_e8m0_half(blk, mask) * _e2m1_doubled(q)
    elif QTYPE == IQ4_XS:  # d | scales_h u16 | scales_l 4 | codes 128 (16 per 32 values)
        blk = row_ptr + (ks // 256) * 136
        i = ks % 256
        ib = i // 32
        r = i % 32
        lo = (_load_u8(blk + 4 + ib // 2, mask) >> ((ib % 2) * 4)) & 0xF
        hi = (_load_u8(blk + 2 + ib // 4, mask) >> ((ib % 4) * 2)) & 3
        q = (_load_u8(blk + 8 + ib * 16 + r % 16, mask) >> ((r // 16) * 4)) & 0xF
        dl = _load_f16(blk, mask) * ((lo | (hi << 4)) - 32).to(tl.float32)
        w = dl * _level(tab_ptr, q, mask, IQ4_VALUES)
    elif QTYPE == IQ3_S:  # d | qs 64 | qh 8 | signs 32 | scales 4: a grid point per 4 values
        blk = row_ptr + (ks // 256) * 110
        i = ks % 256
        k = i // 4  # grid point: 8 bits in qs[k], the 9th in bit k of qh
        ib = i // 32
        sc = (_load_u8(blk + 106 + ib // 2, mask) >> ((ib % 2) * 4)) & 0xF
        ninth = (_load_u8(blk + 66 + k // 8, mask) >> (k % 8)) & 1
        idx = _load_u8(blk + 2 + k, mask) | (ninth << 8)
        g = tl.load(tab_ptr + IQ3_S_GRID + idx * 4 + i % 4, mask=mask, other=0).to(tl.float32)
        w = (_load_f16(blk, mask) * (1 + 2 * sc).to(tl.float32)) * g
        w = tl.where(((_load_u8(blk + 74 + i // 8, mask) >> (i % 8)) & 1) == 1, -w, w)
    elif QTYPE == IQ3_XXS:  # d | qs 64 | 8 x uint32
        w = _xxs_value(row_ptr + (ks // 256) * 98, ks % 256, mask, tab_ptr, IQ3_XXS_GRID, 4,
                       66, 4, 0.5)  # fmt: skip
    elif QTYPE == IQ2_XXS:  # d | 8 x (4 grid indices | uint32)
        w = _xxs_value(row_ptr + (ks // 256) * 66, ks % 256, mask, tab_ptr, IQ2_XXS_GRID, 8,
                       6, 8, 0.25)  # fmt: skip
    elif QTYPE == IQ2_XS:  # d | 32 x uint16 (9-bit grid index, 7-bit sign index) | scales 8
        blk = row_ptr + (ks // 256) * 74
        i = ks % 256
        q = _load_u16(blk + 2 + 2 * (i // 8), mask)
        g = _load_u8(tab_ptr + IQ2_XS_GRID + (q & 511) * 8 + i % 8, mask).to(tl.float32)
        w = ((_load_f16(blk, mask) * _iq2_scale(blk + 66, i, mask)) * 0.25) * g
        w = _signed(w, tab_ptr, q >> 9, i % 8, mask)
    elif QTYPE == IQ2_S:  # d | qs 32 | signs 32 | qh 8 (grid index bits 8-9) | scales 8
        blk = row_ptr + (ks // 256) * 82
        i = ks % 256
        k = i // 8  # grid point
        high = (_load_u8(blk + 66 + k // 4, mask) >> (2 * (k % 4))) & 3
        idx = _load_u8(blk + 2 + k, mask) | (high << 8)
        g = _load_u8(tab_ptr + IQ2_S_GRID + idx * 8 + i % 8, mask).to(tl.float32)
        w = ((_load_f16(blk, mask) * _iq2_scale(blk + 74, i, mask)) * 0.25) * g
        w = tl.where(((_load_u8(blk + 34 + k, mask) >> (i % 8)) & 1) == 1, -w, w)
    else:  # IQ1_S: d | qs 32 | 8 x uint16 (3 x 3 grid index bits, 3-bit scale, delta sign)
        tl.static_assert(QTYPE == IQ1_S, "unsupported GGUF type in dequant_iq")
        blk = row_ptr + (ks // 256) * 50
        i = ks % 256
        k = i // 8  # grid point; 4 per 32 values share a uint16
        qh = _load_u16(blk + 34 + 2 * (k // 4), mask)
        idx = _load_u8(blk + 2 + k, mask) | (((qh >> (3 * (k % 4))) & 7) << 8)
        g = tl.load(tab_ptr + IQ1_S_GRID + idx * 8 + i % 8, mask=mask, other=0)
        delta = tl.where((qh >> 15) == 1, -IQ1S_DELTA, IQ1S_DELTA)
        dl = _load_f16(blk, mask) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        w = dl * (g.to(tl.int8, bitcast=True).to(tl.float32) + delta)
    return w


@triton.jit
def grid_block(blk, b, p, j, mask, tab_ptr, QTYPE: tl.constexpr):
    """The super-block of grid type QTYPE at byte address `blk` [R, 1, 1, 1] as a tile over
    b [1, 8, 1, 1] (32-value block), p [1, 1, P, 1] (grid point) and j [1, 1, 1, W] (value;
    W = grid_width(QTYPE), P = 32 / W): value 32b + W p + j. Returns (g, scale): the signed
    grid values [R, 8, P, W] (IQ1_S's shifted by its delta) and each point's factor
    [R, 8, P, 1], d (0.5 + s) / 2 or / 4 (IQ1_S: d (2 s + 1)); scale * g is the weight."""
    WIDTH: tl.constexpr = grid_width(QTYPE)
    if QTYPE == IQ3_XXS or QTYPE == IQ2_XXS:  # noqa: SIM109 (Triton has no `in`)
        # the grid indices: 8 bytes per 32 values; then a uint32 per 32 values
        code = _load_u8(blk + 2 + 8 * b + p, mask)  # [R, 8, P, 1]
        if QTYPE == IQ3_XXS:
            aux = _load_u32(blk + 66 + 4 * b, mask)  # [R, 8, 1, 1]
            grid_at = IQ3_XXS_GRID
            mult = 0.5
        else:
            aux = _load_u32(blk + 6 + 8 * b, mask)
            grid_at = IQ2_XXS_GRID
            mult = 0.25
        group = (WIDTH * p) // 8  # the point's 8 values' 7-bit sign index
        signs = _load_u8(tab_ptr + KSIGNS + ((aux >> (7 * group)) & 127), mask)
        signs = signs >> ((WIDTH * p) % 8)
        factor = 0.5 + ((aux >> 28) & 0xF).to(tl.float32)
    elif QTYPE == IQ2_XS:  # a uint16 per point: 9-bit grid index, 7-bit sign index
        q = _load_u16(blk + 2 + 8 * b + 2 * p, mask)
        code = q & 511
        signs = _load_u8(tab_ptr + KSIGNS + (q >> 9), mask)
        factor = 0.5 + ((_load_u8(blk + 66 + b, mask) >> (4 * (p // 2))) & 0xF).to(tl.float32)
        grid_at = IQ2_XS_GRID
        mult = 0.25
    elif QTYPE == IQ2_S:  # qs | signs | qh (index bits 8-9) | scales, a byte per point
        high = (_load_u8(blk + 66 + b, mask) >> (2 * p)) & 3
        code = _load_u8(blk + 2 + 4 * b + p, mask) | (high << 8)
        signs = _load_u8(blk + 34 + 4 * b + p, mask)
        factor = 0.5 + ((_load_u8(blk + 74 + b, mask) >> (4 * (p // 2))) & 0xF).to(tl.float32)
        grid_at = IQ2_S_GRID
        mult = 0.25
    else:  # IQ1_S: qs | a uint16 per 32 values (3 x 3 index bits, 3-bit scale, delta sign)
        tl.static_assert(QTYPE == IQ1_S, "grid_block reads IQ3_XXS, IQ2_XXS/XS/S, IQ1_S")
        qh = _load_u16(blk + 34 + 2 * b, mask)  # [R, 8, 1, 1]
        code = _load_u8(blk + 2 + 4 * b + p, mask) | (((qh >> (3 * p)) & 7) << 8)
        factor = (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        grid_at = IQ1_S_GRID
    if WIDTH == 4:  # the point's values as one word of the table
        word = tl.load((tab_ptr + grid_at + 4 * code).to(tl.pointer_type(tl.int32)),
                       mask=mask, other=0)  # fmt: skip
    else:
        word = tl.load((tab_ptr + grid_at + 8 * code).to(tl.pointer_type(tl.int64)),
                       mask=mask, other=0)  # fmt: skip
    g = ((word >> (8 * j)) & 0xFF).to(tl.int32)  # [R, 8, P, W]
    d = _load_f16(blk, mask)
    if QTYPE == IQ1_S:  # grid values -1, 0, 1 (as bytes), shifted by +-delta
        delta = tl.where((qh >> 15) == 1, -IQ1S_DELTA, IQ1S_DELTA)
        g = tl.where(g > 127, g - 256, g).to(tl.float32) + delta
        scale = d * factor
    else:
        g = tl.where(((signs >> j) & 1) == 1, -g, g).to(tl.float32)
        scale = (d * factor) * mult
    return g, scale
