"""Byte-field readers shared by the GGUF dequantizers (`kernels/quant*.py`).

Blocks arrive as uint8 rows at any byte offset (a tensor sliced out of a mmapped file or out
of an expert blob), so a multi-byte field is never read through a dtype view of the caller's
storage: fp16 fields are copied first, and integer fields are assembled from their bytes.
Bit-field shifts are built with `torch.arange` on the data's device, so no small host tensor
is copied to a GPU per call.
"""

from __future__ import annotations

import torch


def fp16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 little-endian fp16 -> [n, 1] float32."""
    # A dtype view needs an even storage offset, which a slice of one block at an odd byte
    # offset does not have; the copy is two bytes per block.
    return b.clone(memory_format=torch.contiguous_format).view(torch.float16).float()


def uint_le(b: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 little-endian unsigned integer (k <= 4) -> [...] int64."""
    shifts = torch.arange(0, 8 * b.shape[-1], 8, dtype=torch.int64, device=b.device)
    # the shifted bytes do not overlap, so their sum is their bitwise OR
    return (b.long() << shifts).sum(dim=-1)


def steps(count: int, step: int, like: torch.Tensor) -> torch.Tensor:
    """[count] shift amounts 0, step, 2 step, ... in `like`'s dtype and device."""
    return torch.arange(0, count * step, step, dtype=like.dtype, device=like.device)


def split_bits(x: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """x [..., m] -> [..., m, count]: the `count` fields of `width` bits of each element,
    lowest first."""
    return (x.unsqueeze(-1) >> steps(count, width, x)) & ((1 << width) - 1)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32]: low nibbles are values 0..15, high are 16..31
    (the 32-value block layout of Q4_0, Q5_0, IQ4_NL and the sub-blocks of IQ4_XS)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)
