"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, accumulated in float32.

The order follows llama.cpp (normalize in float32, multiply by the weight in float32, round
once to the output dtype), not Hugging Face's (which rounds the normalized value to the
input dtype before the weight multiply); the two differ by one rounding in half precision.

Three tiers: `_rmsnorm_kernel` (Triton), `rmsnorm()` (launcher and operation: any leading
dims), and the torch reference `rmsnorm_ref()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class NormConfig:
    """Launch settings: a row wider than `block_d` is read in steps (twice: sum of squares,
    then scale)."""

    block_d: int = 4096
    num_warps: int = 4


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # [D]
    out_ptr,  # [T, D]
    D,
    stride_xt,
    stride_ot,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xt
    out_row = out_ptr + row * stride_ot
    sum_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = x * rstd * w
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, config: NormConfig | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D] -> [..., D] in x's dtype."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim {D}")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"x and weight must be float, got {x.dtype}, {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device} but weight on {weight.device}")
    cfg = config or NormConfig()
    x2 = x.reshape(-1, D)  # [T, D]; a copy only if the leading dims cannot be merged
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [T, D]
    if x2.shape[0] and D:
        block_d = min(triton.next_power_of_2(D), cfg.block_d)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, weight, out, D, x2.stride(0), out.stride(0), eps,
            BLOCK_D=block_d, num_warps=cfg.num_warps,
        )  # fmt: skip
    return out.reshape(x.shape)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)
