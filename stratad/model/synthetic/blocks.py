"""Random valid GGUF blocks with a chosen spread: the weights of synthetic `--ftype` models.

A synthetic model's weights are random, so nothing needs quantizing: for every block type
the file types use, `random_blocks` fills the quant bits (and i-quant grid indices and sign
bits) with uniform random bits and then writes the block's scales so that the dequantized
values have mean 0 and the requested standard deviation:

- types with a signed scale only (Q8_0, Q4_0, Q5_0, IQ4_NL): one fp16 `d` per block, of
  random sign, so the quants' small offset (-8..7 has mean -1/2) cancels over blocks;
- types with a minimum (Q2_K, Q4_K, Q5_K, Q5_1): each sub-block's minimum equals its scale
  times half the quant range, so values are `d * sc * (q - (levels - 1) / 2)`;
- Q3_K and Q6_K: sub-block scales of random sign; IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS and IQ2_S:
  4-bit sub-block scales 8..15 over the signed grid values; IQ1_S: 3-bit scales 4..7 over its
  grid values (-1, 0, 1) shifted by a delta of random sign (+-1/8 per 32 values);
- MXFP4: a power-of-two scale per block (an E8M0 exponent) over its symmetric levels; a
  power of two cannot hit every spread, so each block takes one of the two exponents around
  it, the upper with the probability that makes the mean square right.

`d` comes from the exact second moment of that construction (the quant levels, the scale
choices and, for IQ4_NL, MXFP4 and the grid types, gguf-py's copy of llama.cpp's value
tables), so the spread is right in expectation, not fitted. Every draw comes from one SFC64
stream seeded by the caller: same seed, same bytes. Vectorised numpy; generating a block costs
less than writing it to disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

# (blocks [n, bytes per block] holding random bytes, target std, the stream) -> None
Writer = Callable[[np.ndarray, float, np.random.BitGenerator], None]


def random_bytes(bits: np.random.BitGenerator, rows: int, cols: int) -> np.ndarray:
    """Uniform random bytes [rows, cols] (writable), straight from the generator's words."""
    n = rows * cols
    words = bits.random_raw(-(-n // 8))
    assert isinstance(words, np.ndarray)
    return words.view(np.uint8)[:n].reshape(rows, cols)


def _mean_square(values: np.ndarray) -> float:
    return float(np.mean(np.asarray(values, dtype=np.float64) ** 2))


def _levels(n: int, offset: float) -> np.ndarray:
    """The values of an n-level quant minus its offset: q - offset for q in 0..n-1."""
    return np.arange(n) - offset


def _fp16_scale(std: float, mean_square: float) -> np.float16:
    d = np.float16(std / np.sqrt(mean_square))
    if not np.isfinite(d) or d == 0:
        raise ValueError(f"std {std} cannot be stored as an fp16 block scale")
    return d


def _put_fp16(blocks: np.ndarray, at: int, value: np.float16, random_sign: bool) -> None:
    """Write `value` at byte `at` of every block; with `random_sign`, its sign bit is the
    random top bit the byte already holds."""
    lo, hi = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    if random_sign:
        blocks[:, at + 1] = (blocks[:, at + 1] & 0x80) | (hi & 0x7F)
    else:
        blocks[:, at + 1] = hi
    blocks[:, at] = lo


# --- 32-value blocks ---------------------------------------------------------------------------


def _signed_scale_only(mean_square: float) -> Writer:
    """Blocks that begin with an fp16 `d` and hold nothing else but quants."""

    def write(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
        _put_fp16(blocks, 0, _fp16_scale(std, mean_square), random_sign=True)

    return write


def _write_q5_1(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    # y = d * q + m with q in 0..31: m = -15.5 d centres it.
    d = _fp16_scale(std, _mean_square(_levels(32, 15.5)))
    _put_fp16(blocks, 0, d, random_sign=False)
    _put_fp16(blocks, 2, np.float16(-15.5 * float(d)), random_sign=False)


@cache
def _iq4nl_mean_square() -> float:
    return _mean_square(np.asarray(gguf_quants.IQ4_NL.kvalues))


def _write_iq4_nl(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    _signed_scale_only(_iq4nl_mean_square())(blocks, std, bits)


def _write_mxfp4(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    # e | qs[16]: y = kvalues[q] 2^(e - 128). The squared scale is 4^a for e = a + 128 and
    # 4^(a + 1) for e = a + 129; taking the upper with probability p makes its mean
    # (1 - p) 4^a + p 4^(a + 1), the target for p = (target / 4^a - 1) / 3.
    target = std**2 / _mean_square(np.asarray(gguf_quants.MXFP4.kvalues))
    a = int(np.floor(np.log2(target) / 2))
    p = (target / 4.0**a - 1) / 3
    e = a + 128 + (np.random.Generator(bits).random(len(blocks)) < p)
    if not 2 <= e.min() <= e.max() <= 254:  # 2^-126..2^126: a normal float, levels finite
        raise ValueError(f"std {std} cannot be stored as an MXFP4 block scale")
    blocks[:, 0] = e


# --- K-quants (256-value super-blocks) -----------------------------------------------------------

_Q4K_SCALES = np.arange(32, 64)  # 6-bit sub-block scales drawn from 32..63


def _pack_k4_scales(sc: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales, used as the minimums too -> the 12 packed bytes of Q4_K/Q5_K
    (`get_scale_min_k4`: bytes 0-3 scales 0-3 plus the top bits of 4-7, bytes 4-7 the same
    for the minimums, bytes 8-11 the low nibbles of scales and minimums 4-7)."""
    low = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((sc[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, low, high], axis=1)


def _with_minimum(levels: int, scales_at: int) -> Writer:
    """Q4_K (16 levels) and Q5_K (32): y = d * sc * q - dmin * m with m = sc and
    dmin = d * (levels - 1) / 2, i.e. d * sc * (q - (levels - 1) / 2)."""
    centre = (levels - 1) / 2
    mean_square = _mean_square(_Q4K_SCALES) * _mean_square(_levels(levels, centre))

    def write(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
        d = _fp16_scale(std, mean_square)
        _put_fp16(blocks, 0, d, random_sign=False)
        _put_fp16(blocks, 2, np.float16(centre * float(d)), random_sign=False)
        sc = 32 | (random_bytes(bits, len(blocks), 8) & 31)
        blocks[:, scales_at : scales_at + 12] = _pack_k4_scales(sc)

    return write


_Q2K_SCALES = np.arange(8, 16)


def _write_q2_k(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    # scales[16] | qs[64] | d | dmin; y = d * (sc & 15) * q - dmin * (sc >> 4), q in 0..3.
    d = _fp16_scale(std, _mean_square(_Q2K_SCALES) * _mean_square(_levels(4, 1.5)))
    sc = 8 | (blocks[:, :16] & 7)
    blocks[:, :16] = sc | (sc << 4)
    _put_fp16(blocks, 80, d, random_sign=False)
    _put_fp16(blocks, 82, np.float16(1.5 * float(d)), random_sign=False)


_Q3K_SCALES = np.arange(16, 32)  # |scale - 32|, of random sign


def _write_q3_k(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    # hmask[32] | qs[64] | scales[12] | d; q = low 2 bits - (4 unless the hmask bit is set),
    # i.e. -4..3; the 6-bit scales are stored plus 32.
    d = _fp16_scale(std, _mean_square(_Q3K_SCALES) * _mean_square(np.arange(-4, 4)))
    r = random_bytes(bits, len(blocks), 16)
    magnitude = 16 | (r & 15)
    s = np.where(r & 0x80, 32 - magnitude, 32 + magnitude).astype(np.uint8)  # [n, 16]
    packed = np.empty((len(blocks), 12), dtype=np.uint8)
    packed[:, :8] = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    top = (s >> 4).reshape(-1, 4, 4)  # [n, k // 4, k % 4]: 2 bits each
    packed[:, 8:] = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    blocks[:, 96:108] = packed
    _put_fp16(blocks, 108, d, random_sign=False)


_Q6K_SCALES = np.arange(64, 128)  # |int8 scale|, of random sign


def _write_q6_k(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    # ql[128] | qh[64] | scales[16] int8 | d; y = d * sc * (q - 32), q in 0..63.
    d = _fp16_scale(std, _mean_square(_Q6K_SCALES) * _mean_square(_levels(64, 32)))
    r = blocks[:, 192:208]
    magnitude = (64 | (r & 63)).astype(np.int16)
    blocks[:, 192:208] = np.where(r & 0x80, -magnitude, magnitude).astype(np.int8).view(np.uint8)
    _put_fp16(blocks, 208, d, random_sign=False)


# --- i-quants ------------------------------------------------------------------------------------

_SCALES = np.arange(8, 16)  # the i-quants' 4-bit sub-block scales s, drawn from 8..15


@cache
def _grid_mean_square(name: str) -> float:
    """The mean square of an i-quant's grid values (every grid point equally likely)."""
    quant = getattr(gguf_quants, name)
    quant.init_grid()
    assert quant.grid is not None
    return _mean_square(quant.grid)


def _grid_type(name: str, factors: np.ndarray, scales_at: slice | np.ndarray, both: bool) -> Writer:
    """An i-quant whose grid indices and sign bits stay uniform random (every index is a grid
    point; each sign is as often minus as plus, the 7-bit sign indices included): d from the
    grid's second moment and that of d's factor per scale s (`factors`); the 4-bit scales at
    bytes `scales_at` drawn from 8..15 (both nibbles, or only the high one)."""
    mean_square = _mean_square(factors) * _grid_mean_square(name)

    def write(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
        _put_fp16(blocks, 0, _fp16_scale(std, mean_square), random_sign=False)
        r = blocks[:, scales_at]
        high = (8 | ((r >> 4) & 7)) << 4
        blocks[:, scales_at] = high | ((8 | (r & 7)) if both else (r & 0x0F))

    return write


_IQ1S_SCALES = np.arange(4, 8)  # IQ1_S's 3-bit sub-block scales s, drawn from 4..7


@cache
def _iq1s_mean_square() -> float:
    # (g + delta)^2 with delta = +-1/8 of random sign, independent of g: E g^2 + delta^2
    delta = float(gguf_quants.IQ1_S.delta)
    return _mean_square(2 * _IQ1S_SCALES + 1) * (_grid_mean_square("IQ1_S") + delta**2)


def _write_iq1_s(blocks: np.ndarray, std: float, bits: np.random.BitGenerator) -> None:
    # d | qs[32] | qh 8 x uint16 (index bits 8-10 of 4 grid points, 3-bit scale s at bits
    # 12-14, the delta's sign at 15): y = d (2 s + 1) (g +- 1/8). Every 11-bit index is a grid
    # point; setting bit 14 draws s from 4..7.
    _put_fp16(blocks, 0, _fp16_scale(std, _iq1s_mean_square()), random_sign=False)
    blocks[:, 35:50:2] |= 0x40


_WRITERS: Mapping[QType, Writer] = {
    QType.Q8_0: _signed_scale_only(_mean_square(np.arange(-128, 128))),
    QType.Q4_0: _signed_scale_only(_mean_square(_levels(16, 8))),
    QType.Q5_0: _signed_scale_only(_mean_square(_levels(32, 16))),
    QType.Q5_1: _write_q5_1,
    QType.IQ4_NL: _write_iq4_nl,
    QType.MXFP4: _write_mxfp4,
    QType.Q2_K: _write_q2_k,
    QType.Q3_K: _write_q3_k,
    QType.Q4_K: _with_minimum(16, scales_at=4),
    QType.Q5_K: _with_minimum(32, scales_at=4),
    QType.Q6_K: _write_q6_k,
    # d | qs[64] | qh[8] | signs[32] | scales[4]: d (1 + 2 s)
    QType.IQ3_S: _grid_type("IQ3_S", 1 + 2 * _SCALES, slice(106, 110), both=True),
    # d | qs[64] | 8 x uint32 (4 x 7-bit sign indices, s on top): d (0.5 + s) / 2
    QType.IQ3_XXS: _grid_type("IQ3_XXS", (0.5 + _SCALES) / 2, 66 + 4 * np.arange(8) + 3,
                              both=False),
    # d | 8 x (4 grid indices | uint32 as IQ3_XXS's): d (0.5 + s) / 4
    QType.IQ2_XXS: _grid_type("IQ2_XXS", (0.5 + _SCALES) / 4, 2 + 8 * np.arange(8) + 7,
                              both=False),
    # d | 32 x uint16 (9-bit grid index, 7-bit sign index) | scales[8]: d (0.5 + s) / 4
    QType.IQ2_XS: _grid_type("IQ2_XS", (0.5 + _SCALES) / 4, slice(66, 74), both=True),
    # d | qs[32] | signs[32] | qh[8] (index bits 8-9) | scales[8]: d (0.5 + s) / 4
    QType.IQ2_S: _grid_type("IQ2_S", (0.5 + _SCALES) / 4, slice(74, 82), both=True),
    QType.IQ1_S: _write_iq1_s,
}

BLOCK_TYPES: frozenset[QType] = frozenset(_WRITERS)


def random_blocks(qtype: QType, n_values: int, std: float, seed: int) -> np.ndarray:
    """Random `qtype` blocks holding `n_values` values of mean 0 and standard deviation
    `std`: uint8 [n_blocks, bytes per block], deterministic in `seed`."""
    if qtype not in _WRITERS:
        raise ValueError(f"no random block writer for {qtype.name}")
    block, nbytes = GGML_QUANT_SIZES[qtype]
    if n_values % block:
        raise ValueError(f"{n_values} values is not whole {qtype.name} blocks of {block}")
    bits = np.random.SFC64(seed)
    blocks = random_bytes(bits, n_values // block, nbytes)
    _WRITERS[qtype](blocks, std, bits)
    return blocks
