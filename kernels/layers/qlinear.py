"""Decode's dense projections read in their GGUF type, dotted in int8: out [T, N] = x [T, K] @ W^T.

The offload engine keeps its dense weights (attention, router, output head) dequantized to
bf16, 16 bits a weight, and reads them with `kernels.layers.linear.decode_linear` near the
memory's rate. A Q4_K_M file holds them in 4.5 to 6.6 bits: read as stored, a token's dense
bytes shrink about threefold. This launcher runs the MoE kernels' int8 row dots
(`kernels.experts.moe_dots_q8`: Q4_K, Q5_K, Q6_K and Q8_0) over one matrix: the activation is
quantized to 8 bits per 32 values once (`quantize_q8`), and each program dots `block_n` rows
with every token's Q8 row in turn, so a step of T tokens reads the weights from memory once
(the rows' later passes hit the cache) instead of T times. The row dots' arithmetic per row
is that of the MoE kernels: a row's result does not depend on the batch or on the rows a
program holds (the super-blocks a reduction step takes set the order of its sums).

Three tiers: `_qlinear_kernel` (Triton), `qlinear()` (launcher: checks, grid) and the torch
reference `qlinear_ref()` (the activation rounded to its Q8 row, then float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.experts.moe_dots_q8 import (
    Q8_DOT_QTYPES,
    dequantize_q8_ref,
    dp4a_in_asm,
    q8_row_bytes,
    q8_rows_dot,
    quantize_q8,
    quantize_q8_ref,
)
from kernels.formats.quant import QTensor, QType, row_bytes
from kernels.layers.linear import MAX_TOKENS


@dataclass(frozen=True)
class QLinearConfig:
    """Launch settings; the MoE launches' measured best for the int8 readers (H100, r18)."""

    block_n: int = 4  # rows per program (a power of two)
    super_blocks: int = 1  # K-quant super-blocks per reduction step (a power of two)
    num_warps: int = 1
    num_stages: int = 2
    # the most tokens a step reads through the GGUF blocks (at most MAX_TOKENS); a step of
    # more reads the bf16 copy
    max_tokens: int = MAX_TOKENS

    def __post_init__(self) -> None:
        for name in ("block_n", "super_blocks"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")


@triton.jit
def _qlinear_kernel(
    x8_ptr,  # [T, X8_ROW] uint8: x's Q8 rows
    w_ptr,  # [N, ROW_BYTES] uint8 GGUF blocks
    out_ptr,  # [T, N]
    T,
    N,
    K,
    ROW_BYTES,
    X8_ROW,
    stride_ot,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SBS: tl.constexpr,
    ASM: tl.constexpr,  # dp4a as inline PTX (else its emulation)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row_at = w_ptr + rows.to(tl.int64) * ROW_BYTES
    x8_at, out_at = x8_ptr, out_ptr + rows  # token t's, advanced a row each pass
    for _ in range(T):
        acc = q8_rows_dot(row_at, rmask, x8_at, K, QTYPE, BLOCK_N, SBS, ASM)
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=rmask)
        x8_at += X8_ROW
        out_at += stride_ot


def qlinear(
    x: torch.Tensor, blocks: torch.Tensor, qtype: QType, config: QLinearConfig = QLinearConfig(),
    x8: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [T, K] (float) @ dequant(blocks [N, row_bytes])^T -> [T, N] in x's dtype, the
    activation dotted as its Q8 rows (`x8`: `quantize_q8(x)` made already, for several
    matrices). `blocks`: contiguous GGUF blocks of `qtype` (one of Q4_K, Q5_K, Q6_K, Q8_0),
    starting 4-byte aligned."""
    if qtype not in Q8_DOT_QTYPES:
        names = ", ".join(sorted(q.name for q in Q8_DOT_QTYPES))
        raise ValueError(f"qlinear reads {names}, not {qtype.name}")
    if x.dim() != 2 or blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(
            f"expected x [T, K] and uint8 blocks [N, row_bytes], got {tuple(x.shape)} and"
            f" {blocks.dtype} {tuple(blocks.shape)}"
        )
    t, k = x.shape
    if blocks.shape[1] != row_bytes(qtype, k):  # raises for a K the blocks do not divide
        raise ValueError(f"{qtype.name} rows of {k} values are {row_bytes(qtype, k)} bytes,"
                         f" the blocks' rows {blocks.shape[1]}")  # fmt: skip
    if not blocks.is_contiguous() or blocks.data_ptr() % 4:
        raise ValueError("the blocks must be contiguous and start 4-byte aligned")
    if x.device != blocks.device:
        raise ValueError(f"x on {x.device} but blocks on {blocks.device}")
    n = blocks.shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if x8 is None:
        x8 = quantize_q8(x.contiguous())
    elif x8.shape != (t, q8_row_bytes(k)) or x8.dtype != torch.uint8 or x8.device != x.device:
        raise ValueError(f"x8 must be x's Q8 rows, uint8 [{t}, {q8_row_bytes(k)}]")
    _qlinear_kernel[(triton.cdiv(n, config.block_n),)](
        x8, blocks, out, t, n, k, blocks.shape[1], x8.shape[1], out.stride(0),
        QTYPE=int(qtype), BLOCK_N=config.block_n, SBS=config.super_blocks,
        ASM=dp4a_in_asm(x.device), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def qlinear_ref(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Torch reference: x rounded to its Q8 rows, the weight dequantized, float32."""
    xq = dequantize_q8_ref(quantize_q8_ref(x.float().cpu()), x.shape[1])
    return (xq @ w.dequantize().float().cpu().t()).to(x.dtype)
