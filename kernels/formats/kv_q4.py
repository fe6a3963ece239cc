"""The 4-bit KV cache format: per 32 values of a head, a float16 scale and minimum, and each
value's 4-bit code (as llama.cpp's `q4_1`, 5 bits a value in all against int8's 8.25).

Per layer, the K and V caches are uint8 [S, Hkv, D / 2] (two codes a byte: value 2j in the
low nibble, 2j + 1 in the high one), beside each group's float16 (scale, minimum) pair
[S, Hkv, D / 32, 2] (`k_scale`, `v_scale`: llama.cpp's `dm`). For a group's 32 values x
(float32):

    low   = fp16(min x),  scale = fp16((max x - low) / 15)
    q     = clamp(rint((x - low) / scale), 0, 15)      (q = 0 where scale == 0)
    x    ~= q * scale + low

(the codes are computed from the rounded scale and minimum, so what a reader gets back is
exactly q * scale + low in float32). On the default model this form costs more perplexity
than int8 (bench/results: `ppl.smollm2.q4kv_delta`); its point is memory, 0.625 bytes a
value. The decode attention kernel reads the codes, scales and minimums directly
(`kernels.layers.attention`), dequantizing each step's rows in registers; `dequantize_kv4`
is the references' way in. Torch alone, as `kv_int8`.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale and minimum
LEVELS = 15  # the largest code


def check_dim(d: int) -> None:
    if d % GROUP:
        raise ValueError(f"head dim {d} is not a whole number of {GROUP}-value groups")


def quantize_kv4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (codes uint8 [..., D / 2], float16 (scale, minimum) pairs
    [..., D / 32, 2])."""
    d = x.shape[-1]
    check_dim(d)
    g = x.float().reshape(*x.shape[:-1], d // GROUP, GROUP)
    low = g.amin(-1).half()
    scale = ((g.amax(-1) - low.float()) / LEVELS).half()
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = ((g - low.float()[..., None]) / safe[..., None]).round().clamp(0, LEVELS)
    q = q.to(torch.uint8).reshape(*x.shape[:-1], d)
    return q[..., 0::2] | (q[..., 1::2] << 4), torch.stack([scale, low], dim=-1)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 2] -> the codes uint8 [..., D] (value 2j low nibble, 2j + 1 high)."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)


def dequantize_kv4(codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """codes [..., D / 2] and (scale, minimum) pairs [..., D / 32, 2] -> float32 [..., D]."""
    q = unpack_codes(codes).float()
    d = q.shape[-1]
    g = q.reshape(*q.shape[:-1], d // GROUP, GROUP)
    dmf = dm.float()
    return (g * dmf[..., 0:1] + dmf[..., 1:2]).reshape(q.shape)
