"""Rotary position embedding on q/k [T, H, D], NEOX (halves) or interleaved (pairs) style.

The first `rotary_dim` features of each head are rotated in pairs by angle
`position * inv_freq[i]` (float32); the rest pass through. The two pairings:
    NEOX (GPT-NeoX, Hugging Face Llama/Qwen): (i, i + rotary_dim / 2)
    INTERLEAVED (GPT-J, llama.cpp's default mode): (2 i, 2 i + 1)
`inv_freq` is an argument rather than (dim, theta) so that scaled variants (Llama 3,
YaRN) only change how it is built; `rope_inv_freq()` gives the plain one.

Three tiers: `_rope_kernel` (Triton), `rope()` (launcher, one tensor), `apply_rope()` (q and
k of one layer). `rope_ref()` is the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import triton
import triton.language as tl


class RopeStyle(str, Enum):
    NEOX = "neox"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class RopeConfig:
    block_h: int = 4  # heads per program
    num_warps: int = 4


def rope_inv_freq(
    rotary_dim: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """[rotary_dim / 2] float32: theta ** (-2 i / rotary_dim), as Hugging Face builds it."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (theta ** (exponents / rotary_dim))


@triton.jit
def rope_pairs(i, HALF: tl.constexpr, NEOX: tl.constexpr):
    """The features rotated together as pair i: (i, i + HALF) in NeoX's halves, (2i, 2i + 1)
    interleaved."""
    if NEOX:
        first = i
        second = i + HALF
    else:
        first = 2 * i
        second = 2 * i + 1
    return first, second


@triton.jit
def rope_rotate(a, b, cos, sin):
    """Pair (a, b) rotated by the angle whose cos and sin are given (float32)."""
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, H, D]
    pos_ptr,  # [T]
    freq_ptr,  # [HALF]
    cos_ptr,  # [P, HALF] float32 tables by position (TABLE), else unused
    sin_ptr,
    out_ptr,  # [T, H, D]; the pass-through features are copied by the launcher
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TABLE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    i = tl.arange(0, BLOCK_HALF)  # [BP] pair index
    if TABLE:
        row = tl.load(pos_ptr + t).to(tl.int64) * HALF
        cos = tl.load(cos_ptr + row + i, mask=i < HALF, other=1.0)[None, :]
        sin = tl.load(sin_ptr + row + i, mask=i < HALF, other=0.0)[None, :]
    else:
        pos = tl.load(pos_ptr + t).to(tl.float32)
        inv_freq = tl.load(freq_ptr + i, mask=i < HALF, other=0.0)
        angle = pos * inv_freq
        cos = tl.cos(angle)[None, :]
        sin = tl.sin(angle)[None, :]
    first, second = rope_pairs(i, HALF, NEOX)
    mask = (heads[:, None] < H) & (i[None, :] < HALF)  # [BH, BP]
    x_at = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    out_at = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_at + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + second[None, :], mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rope_rotate(x1, x2, cos, sin)
    tl.store(out_at + first[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + second[None, :], y2.to(out_ptr.dtype.element_ty), mask=mask)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    style: RopeStyle,
    config: RopeConfig | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rotate x [T, H, D] (may be a strided view) at positions [T] -> new tensor [T, H, D].
    With `tables` (see `rope_table`), cos and sin are read by position, not computed."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D], got shape {tuple(x.shape)}")
    T, H, D = x.shape
    half = inv_freq.shape[0]
    if inv_freq.dim() != 1 or 2 * half > D:
        raise ValueError(f"inv_freq {tuple(inv_freq.shape)} does not fit head dim {D}")
    if positions.shape != (T,) or positions.is_floating_point():
        raise ValueError(
            f"positions must be integers [T={T}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if inv_freq.dtype != torch.float32 or not x.is_floating_point():
        raise TypeError(f"need float x and float32 inv_freq, got {x.dtype}, {inv_freq.dtype}")
    if not (x.device == positions.device == inv_freq.device):
        raise ValueError("x, positions and inv_freq must be on one device")
    style = RopeStyle(style)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if 2 * half < D:
        out[..., 2 * half :] = x[..., 2 * half :]
    if T == 0 or H == 0 or half == 0:
        return out
    cfg = config or RopeConfig()
    block_h = min(triton.next_power_of_2(H), cfg.block_h)
    grid = (T, triton.cdiv(H, block_h))
    cos, sin = tables if tables is not None else (inv_freq, inv_freq)
    _rope_kernel[grid](
        x, positions.contiguous(), inv_freq.contiguous(), cos, sin, out, H,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HALF=half, NEOX=style == RopeStyle.NEOX, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half), TABLE=tables is not None,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def rope_table(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    style: RopeStyle,
    config: RopeConfig | None = None,
) -> torch.Tensor:
    """`rope` with the angles' cos and sin precomputed by position ([P, D/2] float32, e.g.
    from float64 angles, which stay exact at long positions where float32 angles drift)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32 [P, half], got {tuple(cos.shape)}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin tables must be contiguous")
    inv_freq = torch.empty(cos.shape[1], dtype=torch.float32, device=cos.device)
    return rope(x, positions, inv_freq, style, config, tables=(cos, sin))


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    style: RopeStyle,
    config: RopeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate one layer's q [T, Hq, D] and k [T, Hkv, D]."""
    return rope(q, positions, inv_freq, style, config), rope(k, positions, inv_freq, style, config)


def rope_ref(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, style: RopeStyle
) -> torch.Tensor:
    half = inv_freq.shape[0]
    angle = positions.float()[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [T, 1, half]
    rot = x[..., : 2 * half].float()
    if RopeStyle(style) == RopeStyle.NEOX:
        x1, x2 = rot[..., :half], rot[..., half:]
        y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([y.to(x.dtype), x[..., 2 * half :]], dim=-1)
