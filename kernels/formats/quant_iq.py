"""GGUF i-quants (IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S) and MXFP4, in
pure torch.

Dequantizers take blocks [n, bytes per block] (uint8) and return values [n, block] (float32),
bit-identical with llama.cpp's dequantize_row_iq* (as ported by gguf-py): the fp16 scale is
widened to float32 and combined with the sub-block scale in llama.cpp's order, e.g. IQ2_XXS's
`d * (0.5 + s) * 0.25`, then multiplied by the codebook value and by the sign (±1, exact).

Most i-quants store indices into a lattice codebook (the "grid": 4 or 8 small integers per
entry) plus sign bits; IQ4_NL/IQ4_XS store 4-bit indices into a 16-value non-linear table.
MXFP4 is IQ4_NL's cousin: 4-bit indices into the doubled E2M1 levels, scaled by a power of two
stored as one E8M0 exponent byte instead of an fp16 `d` (the product is exact). The tables are
read from the gguf package (which holds llama.cpp's tables) and kept as torch tensors, built once
per device on first use.

Block layouts (bytes; d is the fp16 scale):
    IQ4_NL  (18, 32 values): d | qs 16 (4-bit indices, low nibbles first)
    MXFP4   (17, 32 values): e (E8M0) | qs 16 (as IQ4_NL's)
    IQ4_XS  (136):  d | scales_h 2 | scales_l 4 | qs 128 (8 sub-blocks laid out as IQ4_NL)
    IQ3_XXS (98):   d | qs 64 (grid of 4) | 8 x uint32 (4 x 7-bit sign index, 4-bit scale)
    IQ3_S   (110):  d | qs 64 | qh 8 (9th index bit) | signs 32 | scales 4 (4-bit)
    IQ2_XXS (66):   d | 8 x (4 grid indices (grid of 8) | uint32 as IQ3_XXS's)
    IQ2_XS  (74):   d | 32 x uint16 (9-bit index, 7-bit sign index) | scales 8 (4-bit)
    IQ2_S   (82):   d | qs 32 | signs 32 | qh 8 (2 more index bits) | scales 8 (4-bit)
    IQ1_S   (50):   d | qs 32 | 8 x uint16 (3 x 3 index bits, 3-bit scale, delta sign)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from kernels.formats.quant_fields import fp16, nibbles, split_bits, uint_le

QK_K = 256


# --- tables ------------------------------------------------------------------------------
# Cached per (type, device): a GPU dequantizes with tables already in its memory, and a
# process touches a handful of devices, so the cache stays small.


@cache
def _grid(qtype: QType, device: torch.device) -> torch.Tensor:
    """The codebook of an i-quant: [entries, values per entry] float32 on `device`."""
    quant = getattr(gguf_quants, qtype.name)
    quant.init_grid()  # gguf-py decodes its packed table on first use
    grid = np.ascontiguousarray(quant.grid.reshape(quant.grid_shape), dtype=np.float32)
    return torch.from_numpy(grid).to(device)


@cache
def _ksigns(device: torch.device) -> torch.Tensor:
    """[128] uint8: 7 stored sign bits -> 8 sign bits (the 8th makes the count of minus signs
    even), as llama.cpp's ksigns_iq2xs."""
    table = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    return torch.from_numpy(table).to(device)


@cache
def _kvalues(device: torch.device) -> torch.Tensor:
    """[16] float32: IQ4_NL's non-linear 4-bit levels (llama.cpp's kvalues_iq4nl)."""
    return torch.tensor(gguf_quants.IQ4_NL.kvalues, dtype=torch.float32, device=device)


@cache
def _kvalues_mxfp4(device: torch.device) -> torch.Tensor:
    """[16] float32: MXFP4's E2M1 levels doubled (llama.cpp's kvalues_mxfp4)."""
    return torch.tensor(gguf_quants.MXFP4.kvalues, dtype=torch.float32, device=device)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """[...] uint8 E8M0 exponents -> [...] float32 2^(e - 128): half the scale 2^(e - 127)
    they encode, as the levels are doubled. llama.cpp's ggml_e8m0_to_fp32_half, built from
    the bits: e = 0 and 1 are the subnormals 2^-128 and 2^-127."""
    e = e.int()
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _signs(masks: torch.Tensor) -> torch.Tensor:
    """[...] uint8 sign masks -> [..., 8] float32: -1 where bit j is set, else +1."""
    return 1.0 - 2.0 * split_bits(masks, 8, 1).float()


def _packed_signs(aux: torch.Tensor) -> torch.Tensor:
    """[n, g] int64 words holding 4 x 7-bit sign indices -> [n, g, 4, 8] float32 signs."""
    index = split_bits(aux, 4, 7)  # [n, g, 4]
    return _signs(_ksigns(aux.device)[index])


def _nibble_pairs(b: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 2 m]: low then high nibble of each byte (4-bit sub-block scales)."""
    return split_bits(b, 2, 4).reshape(b.shape[0], -1)


# --- 4-bit non-linear ----------------------------------------------------------------------


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    q = _kvalues(blocks.device)[nibbles(blocks[:, 2:]).long()]  # [n, 32]
    return d * q


def dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = _e8m0_half(blocks[:, :1])  # [n, 1]
    q = _kvalues_mxfp4(blocks.device)[nibbles(blocks[:, 1:]).long()]  # [n, 32]
    return d * q


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    # 8 6-bit scales: low 4 bits from scales_l's nibbles, top 2 from scales_h's 2-bit fields
    hi = split_bits(uint_le(blocks[:, 2:4]), 8, 2)  # [n, 8]
    lo = _nibble_pairs(blocks[:, 4:8]).long()  # [n, 8]
    dl = (d * ((lo | (hi << 4)) - 32).float()).unsqueeze(-1)  # [n, 8, 1]
    qs = nibbles(blocks[:, 8:].reshape(-1, 16)).reshape(-1, 8, 32)  # [n, 8, 32]
    return (dl * _kvalues(blocks.device)[qs.long()]).reshape(-1, QK_K)


# --- 3-bit lattices ------------------------------------------------------------------------


def dequant_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    qs = blocks[:, 2:66]  # [n, 64]: grid indices, 4 values each
    aux = uint_le(blocks[:, 66:98].reshape(-1, 8, 4))  # [n, 8]: one word per 32 values
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).reshape(-1, 8, 1, 1)
    grid = _grid(QType.IQ3_XXS, blocks.device)[qs.long()].reshape(-1, 8, 4, 8)
    return (db * grid * _packed_signs(aux)).reshape(-1, QK_K)


def dequant_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    qs = blocks[:, 2:66]  # [n, 64]: low 8 bits of the grid indices
    qh = split_bits(blocks[:, 66:74], 8, 1).reshape(-1, 64)  # [n, 64]: the 9th bit
    signs = _signs(blocks[:, 74:106]).reshape(-1, 8, 4, 8)
    sc = _nibble_pairs(blocks[:, 106:110])  # [n, 8]
    db = (d * (1 + 2 * sc).float()).reshape(-1, 8, 1, 1)
    index = qs.long() | (qh.long() << 8)
    grid = _grid(QType.IQ3_S, blocks.device)[index].reshape(-1, 8, 4, 8)
    return (db * grid * signs).reshape(-1, QK_K)


# --- 2-bit lattices ------------------------------------------------------------------------


def dequant_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    qs = blocks[:, 2:].reshape(-1, 8, 8)  # [n, 8 groups of 32 values, 8 bytes]
    aux = uint_le(qs[:, :, 4:])  # [n, 8]: sign indices and the 4-bit scale
    db = (d * (0.5 + (aux >> 28).float()) * 0.25).reshape(-1, 8, 1, 1)
    grid = _grid(QType.IQ2_XXS, blocks.device)[qs[:, :, :4].long()]  # [n, 8, 4, 8]
    return (db * grid * _packed_signs(aux)).reshape(-1, QK_K)


def dequant_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    qs = uint_le(blocks[:, 2:66].reshape(-1, 32, 2))  # [n, 32]: 9-bit index, 7-bit sign index
    sc = _nibble_pairs(blocks[:, 66:74])  # [n, 16]: one per 16 values
    db = (d * (0.5 + sc.float()) * 0.25).reshape(-1, 16, 1, 1)
    signs = _signs(_ksigns(blocks.device)[qs >> 9]).reshape(-1, 16, 2, 8)
    grid = _grid(QType.IQ2_XS, blocks.device)[qs & 511].reshape(-1, 16, 2, 8)
    return (db * grid * signs).reshape(-1, QK_K)


def dequant_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    qs = blocks[:, 2:34]  # [n, 32]: low 8 bits of the grid indices
    signs = _signs(blocks[:, 34:66]).reshape(-1, 16, 2, 8)
    qh = split_bits(blocks[:, 66:74], 4, 2).reshape(-1, 32)  # [n, 32]: bits 8-9
    sc = _nibble_pairs(blocks[:, 74:82])  # [n, 16]
    db = (d * (0.5 + sc.float()) * 0.25).reshape(-1, 16, 1, 1)
    index = qs.long() | (qh.long() << 8)
    grid = _grid(QType.IQ2_S, blocks.device)[index].reshape(-1, 16, 2, 8)
    return (db * grid * signs).reshape(-1, QK_K)


# --- 1.5-bit lattice -----------------------------------------------------------------------


def dequant_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    qs = blocks[:, 2:34]  # [n, 32]: low 8 bits of the grid indices
    qh = uint_le(blocks[:, 34:50].reshape(-1, 8, 2))  # [n, 8]: one word per 32 values
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).reshape(-1, 8, 1, 1)
    # the grid's -1/0/1 are shifted by +-delta (IQ1S_DELTA), minus where bit 15 is set
    delta = float(gguf_quants.IQ1_S.delta) * (1 - 2 * (qh >> 15)).float()
    index = qs.long() | (split_bits(qh, 4, 3).reshape(-1, 32) << 8)
    grid = _grid(QType.IQ1_S, blocks.device)[index].reshape(-1, 8, 4, 8)
    return (dl * (grid + delta.reshape(-1, 8, 1, 1))).reshape(-1, QK_K)


DEQUANTIZERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.IQ4_NL: dequant_iq4_nl,
    QType.MXFP4: dequant_mxfp4,
    QType.IQ4_XS: dequant_iq4_xs,
    QType.IQ3_XXS: dequant_iq3_xxs,
    QType.IQ3_S: dequant_iq3_s,
    QType.IQ2_XXS: dequant_iq2_xxs,
    QType.IQ2_XS: dequant_iq2_xs,
    QType.IQ2_S: dequant_iq2_s,
    QType.IQ1_S: dequant_iq1_s,
}
