"""SiLU-gated linear unit: silu(gate) * up, computed in float32.

Three tiers: `_silu_mul_kernel` (Triton), `silu_mul()` (launcher: separate gate and up
tensors, which may be strided views) and `silu_mul_packed()` (a fused gate_up projection
output [..., 2I], gate first). `silu_mul_ref()` is the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class ActivationConfig:
    block: int = 1024  # columns per program
    num_warps: int = 4


@triton.jit
def _silu_mul_kernel(
    g_ptr,  # [T, I]
    u_ptr,  # [T, I]
    out_ptr,  # [T, I]
    I,
    stride_gt,
    stride_ut,
    stride_ot,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(g_ptr + row * stride_gt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_ut + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, config: ActivationConfig | None = None
) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] -> [..., I] in gate's dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if not (gate.is_floating_point() and up.is_floating_point()):
        raise TypeError(f"gate and up must be float, got {gate.dtype}, {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate on {gate.device} but up on {up.device}")
    cfg = config or ActivationConfig()
    I = gate.shape[-1]
    g2 = gate.reshape(-1, I)  # [T, I]
    u2 = up.reshape(-1, I)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] and I:
        block = min(triton.next_power_of_2(I), cfg.block)
        grid = (g2.shape[0], triton.cdiv(I, block))
        _silu_mul_kernel[grid](
            g2, u2, out, I, g2.stride(0), u2.stride(0), out.stride(0),
            BLOCK=block, num_warps=cfg.num_warps,
        )  # fmt: skip
    return out.reshape(gate.shape)


def silu_mul_packed(gate_up: torch.Tensor, config: ActivationConfig | None = None) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]: for a merged gate_up projection."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"packed gate_up needs an even last dim, got {gate_up.shape[-1]}")
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul(gate, up, config)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
