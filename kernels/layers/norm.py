"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, accumulated in float32.

The order follows llama.cpp (normalize in float32, multiply by the weight in float32, round
once to the output dtype), not Hugging Face's (which rounds the normalized value to the
input dtype before the weight multiply); the two differ by one rounding in half precision.

Three tiers: `_rmsnorm_kernel` (Triton), `rmsnorm()` (launcher and operation: any leading
dims), and the torch reference `rmsnorm_ref()`; likewise `add_rmsnorm` (the residual add,
the sum of a block's parts and the next norm in one launch) and `add_rmsnorm_ref`.
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


# --- residual add, fused -----------------------------------------------------------------


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [T, D] the residual stream
    parts_ptr,  # [T, P, D] what the block adds to it (e.g. each routed slot's output)
    w_ptr,  # [D]
    sum_ptr,  # [T, D] out: x + the parts, in x's dtype
    out_ptr,  # [T, D] out: RMSNorm of the sum
    D,
    P,
    stride_pt,
    stride_pp,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    add = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p in range(P):  # in order: the result does not depend on scheduling
        part = tl.load(parts_ptr + row * stride_pt + p * stride_pp + cols, mask=mask, other=0.0)
        add += part.to(tl.float32)
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + add).to(sum_ptr.dtype.element_ty)  # rounded once, as the stream is stored
    tl.store(sum_ptr + row * D + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (sf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


MAX_FUSED_D = 16384  # one row in registers


def add_rmsnorm(
    x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x [T, D] plus the parts [T, P, D] summed in float32 (rounded once
    to x's dtype), and its RMSNorm with weight [D]: (sum, normed), in one launch. Decode adds
    every layer's routed slots (`kernels.experts.moe.moe_down`'s parts) this way into the stream and
    norms it for the next block."""
    t, d = x.shape
    if parts.dim() != 3 or parts.shape[0] != t or parts.shape[2] != d or parts.stride(2) != 1:
        raise ValueError(f"parts must be [T, P, D] with contiguous rows, got {tuple(parts.shape)}")
    if weight.shape != (d,) or d > MAX_FUSED_D:
        raise ValueError(f"weight {tuple(weight.shape)} for rows of {d} (at most {MAX_FUSED_D})")
    if not (x.device == parts.device == weight.device):
        raise ValueError("x, parts and weight must be on one device")
    x = x.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    if t and d:
        block_d = triton.next_power_of_2(d)
        _add_rmsnorm_kernel[(t,)](
            x, parts, weight.contiguous(), total, out, d, parts.shape[1], parts.stride(0),
            parts.stride(1), eps, BLOCK_D=block_d, num_warps=4 if block_d <= 4096 else 8,
        )  # fmt: skip
    return total, out


def add_parts(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x [T, D] plus parts [T, P, D] summed in float32, rounded once to x's dtype (torch)."""
    return (x.float() + parts.float().sum(1)).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = add_parts(x, parts)
    return total, rmsnorm_ref(total, weight, eps)
