"""The int8 KV cache format: symmetric int8 per (token, KV head), one float32 scale each.

Per layer, the K and V caches are int8 [S, Hkv, D] (S: a paged pool's slots, or a contiguous
cache's positions; the contiguous decode layout is [B, S, Hkv, D]) beside float32 scales
[S, Hkv] (`k_scale`, `v_scale`). For one head's D values x (float32; a bfloat16/float16 k or
v is widened exactly first):

    scale = max_d |x_d| / 127
    q_d   = clamp(rint(x_d / scale), -127, 127)    (q = 0 where scale == 0: a zero vector)
    x_d  ~= q_d * scale                            (|x_d - q_d * scale| <= scale / 2)

Both divisions are IEEE float32 (correctly rounded), and rint rounds half to even
(torch.round's rule), so the Triton writer (`kernels.layers.kv_quant.quantize_halves`, used
by `attn_input`) and the torch definition here (`quantize_kv`) give the same bits. -128 is
never written: the range is symmetric. Inputs are assumed finite.

The attention kernels read the ints directly, each K row's dot products scaled by its k
scale and each V row's softmax weight by its v scale: there is no dequantized copy.
`dequantize_kv` is the references' way in. Torch alone: the CPU engines read this format
without importing Triton (71 MiB of a process's memory).
"""

from __future__ import annotations

import torch

QMAX = 127  # the largest |q|


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float (typically [T, Hkv, D]) -> (int8 [..., D], float32 scales [...])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / QMAX  # [...]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero vector: 0 / 1
    q = (xf / safe[..., None]).round().clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [..., D] and scales [...] -> float32 [..., D]."""
    if q.dtype != torch.int8 or scale.shape != q.shape[:-1]:
        raise ValueError(
            f"need int8 [..., D] and scales [...], got {q.dtype} {tuple(q.shape)} and "
            f"{tuple(scale.shape)}"
        )
    return q.float() * scale.float()[..., None]
