"""GGUF K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 256-value super-blocks, in pure torch.

Dequantizers take blocks [n, bytes per block] (uint8) and return values [n, 256]
(float32), bit-identical with llama.cpp's dequantize_row_q{2,3,4,5,6}_K: the fp16
super-block scale is widened to float32 and multiplied by the small sub-block scale first,
then by the quant, then the sub-block minimum is subtracted. Floating-point multiplication is
not associative, so `(d * sc) * q` is kept in that order.

Super-block layouts (bytes):
    Q2_K (84):  scales 16 (4-bit scale | 4-bit min per 16 values) | qs 64 (2 bits) | d | dmin
    Q3_K (110): hmask 32 (3rd bit) | qs 64 (low 2 bits) | scales 12 (16 x 6-bit) | d f16
    Q4_K (144): d f16 | dmin f16 | scales 12 (8 x 6-bit scale, 8 x 6-bit min) | qs 128
    Q5_K (176): d f16 | dmin f16 | scales 12 | qh 32 (5th bit) | qs 128
    Q6_K (210): ql 128 (low 4 bits) | qh 64 (high 2 bits) | scales 16 x int8 | d f16

The quantizers here (Q4_K, Q5_K and Q6_K only) are simple (min/max per sub-block, no scale
search): they write valid blocks for synthetic models and tests, not llama.cpp's bytes.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType

from kernels.formats.quant_fields import fp16 as _fp16
from kernels.formats.quant_fields import split_bits

QK_K = 256
K_SCALE_SIZE = 12


def _shifts(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] packed 6-bit scales/mins -> (scales [n, 8], mins [n, 8]) as uint8.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, 4-7 hold mins 0-3; scales/mins 4-7 are
    split between the low/high nibbles of bytes 8-11 and the top 2 bits of bytes 0-7.
    """
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _low_nibbles_k(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: each 32-byte run holds two sub-blocks (low, then high)."""
    q = qs.reshape(-1, 4, 1, 32) >> _shifts([0, 4], qs).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _scaled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K header -> (d * sc [n, 8, 1], dmin * m [n, 8, 1]) in float32."""
    d = _fp16(blocks[:, 0:2])  # [n, 1]
    dmin = _fp16(blocks[:, 2:4])  # [n, 1]
    sc, mn = _scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])  # [n, 8]
    return (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, :16]  # [n, 16]: one per 16 values
    d = _fp16(blocks[:, 80:82])  # [n, 1]
    dmin = _fp16(blocks[:, 82:84])  # [n, 1]
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)  # [n, 16, 1]
    # Each 128-value half is 32 bytes; the 2-bit field k of byte l is value 32 k + l.
    qs = split_bits(blocks[:, 16:80].reshape(-1, 2, 32), 4, 2)  # [n, 2, 32 bytes, 4 fields]
    q = qs.transpose(-1, -2).reshape(-1, 16, 16).float()  # [n, 16, 16]
    return (dl * q - ml).reshape(-1, QK_K)


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    hmask = blocks[:, :32]  # bit j of byte l: the 3rd bit of value 32 j + l
    qs = blocks[:, 32:96]
    scales = blocks[:, 96:108]
    d = _fp16(blocks[:, 108:110])  # [n, 1]
    # 16 6-bit scales. Scale s: low 4 bits in byte s % 8 (its low nibble for s < 8, its high
    # for s >= 8), top 2 bits in 2-bit field s // 4 of byte 8 + s % 4.
    lo = split_bits(scales[:, :8], 2, 4).transpose(-1, -2).reshape(-1, 16)
    hi = split_bits(scales[:, 8:], 4, 2).transpose(-1, -2).reshape(-1, 16)
    sc = (lo | (hi << 4)).to(torch.int8) - 32  # [n, 16]
    dl = (d * sc.float()).unsqueeze(-1)  # [n, 16, 1]
    ql = split_bits(qs.reshape(-1, 2, 32), 4, 2).transpose(-1, -2).reshape(-1, 16, 16)
    h = split_bits(hmask, 8, 1).transpose(-1, -2).reshape(-1, 16, 16)
    # a clear hmask bit means the value is 4 lower (llama.cpp: `hm & m ? 0 : 4`)
    q = ql.to(torch.int8) - ((h ^ 1) << 2).to(torch.int8)  # [n, 16, 16] in -4..3
    return (dl * q.float()).reshape(-1, QK_K)


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, offset = _scaled(blocks)  # [n, 8, 1]
    q = _low_nibbles_k(blocks[:, 16:]).float()  # [n, 8, 32]
    return (scale * q - offset).reshape(-1, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, offset = _scaled(blocks)  # [n, 8, 1]
    qh = blocks[:, 16:48]  # [n, 32]: bit j of byte l is the 5th bit of value 32 * j + l
    ql = _low_nibbles_k(blocks[:, 48:])  # [n, 8, 32]
    hi = (qh.unsqueeze(1) >> _shifts(list(range(8)), qh).reshape(1, 8, 1)) & 0x01
    q = (ql | (hi << 4)).float()  # [n, 8, 32]
    return (scale * q - offset).reshape(-1, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, :128]
    qh = blocks[:, 128:192]
    sc = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    d = _fp16(blocks[:, 208:210])  # [n, 1]
    scale = (d * sc).unsqueeze(-1)  # [n, 16, 1]
    # Each 128-value half: ql holds 64 bytes (low nibble: values 0-63, high: 64-127) and
    # qh 32 bytes (2-bit fields 0..3 are values 32 k + l).
    lo = (ql.reshape(-1, 2, 1, 64) >> _shifts([0, 4], ql).reshape(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(-1, 2, 1, 32) >> _shifts([0, 2, 4, 6], qh).reshape(1, 1, 4, 1)) & 0x03
    q = (lo.reshape(-1, 8, 32) | (hi.reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    return (scale * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


# --- simple quantizers ------------------------------------------------------------------


def _to_fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n] float32 -> [n, 2] uint8."""
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(x), x / torch.where(d == 0, 1.0, d))


def _pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of `_scale_min`: (scales [n, 8], mins [n, 8]) 6-bit ints -> [n, 12] uint8."""
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    lo_d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    lo_m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    m_d = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat([lo_d, lo_m, m_d], dim=-1).to(torch.uint8)


def _pack_nibbles_k(q: torch.Tensor) -> torch.Tensor:
    """[n, 8, 32] values 0..15 -> [n, 128]: inverse of `_low_nibbles_k`."""
    q = q.to(torch.int32).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8).reshape(-1, 128)


def _quantize_affine_k(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: x [n, 8, 32] -> (header [n, 16] uint8, quants [n, 8, 32] in 0..levels)."""
    lo = x.amin(dim=-1).clamp(max=0.0)  # [n, 8]; llama.cpp stores -min >= 0
    hi = x.amax(dim=-1)
    sub_scale = (hi - lo) / levels
    d = (sub_scale.amax(dim=-1) / 63).half().float()  # [n]; rounded as it will be stored
    dmin = ((-lo).amax(dim=-1) / 63).half().float()
    sc = _safe_div(sub_scale, d[:, None]).round().clamp(0, 63)
    mn = _safe_div(-lo, dmin[:, None]).round().clamp(0, 63)
    eff_scale = (d[:, None] * sc).unsqueeze(-1)  # [n, 8, 1]
    eff_min = (dmin[:, None] * mn).unsqueeze(-1)
    q = _safe_div(x + eff_min, eff_scale).round().clamp(0, levels)
    header = torch.cat([_to_fp16_bytes(d), _to_fp16_bytes(dmin), _pack_scale_min(sc, mn)], -1)
    return header, q


def quantize_k(values: torch.Tensor, qtype: QType) -> torch.Tensor:
    """float32 [*rows, cols] -> uint8 [*rows, cols / 256 * bytes per block]."""
    lead = values.shape[:-1]
    x = values.reshape(-1, QK_K)  # [n, 256]
    if qtype == QType.Q4_K:
        header, q = _quantize_affine_k(x.reshape(-1, 8, 32), 15)
        blocks = torch.cat([header, _pack_nibbles_k(q)], dim=-1)
    elif qtype == QType.Q5_K:
        header, q = _quantize_affine_k(x.reshape(-1, 8, 32), 31)
        qi = q.to(torch.int32)
        weights = (1 << torch.arange(8, device=x.device, dtype=torch.int32)).reshape(1, 8, 1)
        qh = ((qi >> 4) * weights).sum(dim=1).to(torch.uint8)  # [n, 32]
        blocks = torch.cat([header, qh, _pack_nibbles_k(qi & 0x0F)], dim=-1)
    elif qtype == QType.Q6_K:
        blocks = _quantize_q6_k(x)
    else:
        raise ValueError(f"{qtype.name} is not a K-quant")
    return blocks.reshape(*lead, -1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """x [n, 256] -> Q6_K blocks [n, 210]: symmetric, 16 sub-blocks of 16."""
    sub = x.reshape(-1, 16, 16)
    sub_scale = sub.abs().amax(dim=-1) / 31  # [n, 16]
    d = (sub_scale.amax(dim=-1) / 127).half().float()  # [n]
    sc = _safe_div(sub_scale, d[:, None]).round().clamp(0, 127)
    eff = (d[:, None] * sc).unsqueeze(-1)  # [n, 16, 1]
    q = (_safe_div(sub, eff).round().clamp(-32, 31) + 32).to(torch.int32).reshape(-1, 256)
    lo = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=x.device, dtype=torch.int32).reshape(1, 1, 4, 1)
    qh = (hi << shifts).sum(dim=2).reshape(-1, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), scales, _to_fp16_bytes(d)], dim=-1)
