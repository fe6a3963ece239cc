"""The depthwise causal convolution of a Gated DeltaNet layer (`stratad.model.graph.deltanet`)
for a decode step of B sequences in one launch: row b is one new token of its own sequence,
whose last K - 1 inputs are held at its own address (a [C, K - 1] float32 contiguous tensor,
updated in place: the oldest dropped, the token's inputs appended).

    out[b, c] = silu(sum_{j < K-1} w[c, j] held_b[c, j] + w[c, K-1] x[b, c])

Each program takes one row and a block of channels, so no two programs touch one held value.
Three tiers: `_conv_rows_kernel` (Triton), `causal_conv_rows()` (launcher) and the torch
reference `causal_conv_rows_ref()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_rows_kernel(
    x_ptr,  # [B, C], rows `stride_x` apart
    w_ptr,  # [C, K] float32
    table_ptr,  # [B] int64: row b's held inputs [C, K - 1] float32 (its address)
    out_ptr,  # [B, C] float32
    C,
    stride_x,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = cs < C
    held = tl.load(table_ptr + b).to(tl.pointer_type(tl.float32)) + cs * (K - 1)
    x = tl.load(x_ptr + b * stride_x + cs, mask=mc, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(K - 1):
        h = tl.load(held + j, mask=mc, other=0.0)
        acc += tl.load(w_ptr + cs * K + j, mask=mc, other=0.0) * h
        if j > 0:
            tl.store(held + (j - 1), h, mask=mc)
    acc += tl.load(w_ptr + cs * K + (K - 1), mask=mc, other=0.0) * x
    tl.store(held + (K - 2), x, mask=mc)
    tl.store(out_ptr + b * C + cs, acc * tl.sigmoid(acc), mask=mc)


def causal_conv_rows(
    x: torch.Tensor, weight: torch.Tensor, held: torch.Tensor, block_c: int = 256
) -> torch.Tensor:
    """x [B, C] (unit stride inside a row), weight [C, K] float32 (K >= 2), held int64 [B]:
    row b's held inputs' address (the caller vouches for them: distinct float32 [C, K - 1]
    contiguous tensors, updated in place) -> out [B, C] float32."""
    b, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"weight [{c}, K >= 2] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if weight.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError("weight float32, x with unit stride inside a row")
    if held.shape != (b,) or held.dtype != torch.int64 or held.device != x.device:
        raise ValueError(f"held: int64 [{b}] on {x.device}, got {held.dtype} {tuple(held.shape)}"
                         f" on {held.device}")  # fmt: skip
    out = torch.empty((b, c), dtype=torch.float32, device=x.device)
    if b:
        block = min(block_c, triton.next_power_of_2(c))
        _conv_rows_kernel[(b, triton.cdiv(c, block))](
            x, weight.contiguous(), held, out, c, x.stride(0), K=weight.shape[1], BLOCK_C=block
        )
    return out


def causal_conv_rows_ref(
    x: torch.Tensor, weight: torch.Tensor, held: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Torch reference: each row's convolution after its held inputs [C, K - 1] (updated in
    place), float32."""
    out = []
    for row, h in zip(x.float(), held, strict=True):
        seq = torch.cat([h, row[:, None]], dim=1)  # [C, K]
        out.append(torch.nn.functional.silu((seq * weight).sum(dim=1)))
        h.copy_(seq[:, 1:])
    return torch.stack(out) if out else x.new_zeros(x.shape, dtype=torch.float32)
