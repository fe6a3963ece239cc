"""A dense projection held as its GGUF blocks on the device, not dequantized: decode dots the
blocks in int8 (`kernels.layers.qlinear`, a third of bf16's bytes for a Q4_K_M file's types);
a step of more rows (prefill) dequantizes them a slice of rows at a time into a scratch of at
most `SCRATCH_BYTES` and runs the GEMM on it, so no bf16 copy of the matrix is kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as fn

from kernels.experts.moe_dots_q8 import Q8_DOT_QTYPES, quantize_q8
from kernels.formats.dequant_blocks import dequant_blocks
from kernels.formats.quant import QTensor, QType, block_geometry
from kernels.layers.qlinear import QLinearConfig, qlinear

SCRATCH_BYTES = 64 << 20  # the most a prefill step dequantizes at once, per projection

RowGroup = tuple[torch.Tensor, QType]  # GGUF rows [rows, row bytes] (uint8) of one type


@dataclass(frozen=True)
class GgufMatrix:
    """A dense projection [N, K] as GGUF blocks: runs of rows of one type each ([rows, row
    bytes] on the device), stacked as the bf16 matrix would stack them."""

    parts: tuple[RowGroup, ...]
    cols: int  # K

    @property
    def rows(self) -> int:
        return sum(blocks.shape[0] for blocks, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for blocks, _ in self.parts)

    def __call__(self, x: torch.Tensor, config: QLinearConfig) -> torch.Tensor:
        """x [T, K] @ the matrix^T -> [T, N], x's rows dotted as their Q8 rows."""
        x8 = quantize_q8(x.contiguous()) if x.shape[0] else None  # once for every run
        outs = [qlinear(x, blocks, qtype, config, x8) for blocks, qtype in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ the matrix^T -> [T, N] by GEMMs over slices of rows dequantized into
        x's dtype (what the bf16 copy gave, to its rounding)."""
        out = torch.empty(x.shape[0], self.rows, dtype=x.dtype, device=x.device)
        at, step = 0, max(1, SCRATCH_BYTES // (self.cols * x.element_size()))
        for blocks, qtype in self.parts:
            for lo in range(0, blocks.shape[0], step):
                part = blocks[lo : lo + step]
                w = dequant_blocks(part.reshape(1, -1), qtype, part.shape[0], self.cols, x.dtype)
                out[:, at : at + part.shape[0]] = fn.linear(x, w[0])
                at += part.shape[0]
        return out


def gguf_rows(t: QTensor) -> RowGroup | None:
    """A 2-D tensor's rows as GGUF blocks [rows, row bytes], or None where the int8 dots do
    not read its type."""
    if t.qtype not in Q8_DOT_QTYPES or len(t.shape) != 2:
        return None
    return t.data.reshape(t.shape[0], -1), t.qtype


def gguf_matrix(groups: Sequence[RowGroup | None], device: torch.device) -> GgufMatrix | None:
    """The groups' rows stacked in order (consecutive groups of one type share a run), or None
    where a group is None (a type the int8 dots do not read)."""
    runs: list[tuple[list[torch.Tensor], QType]] = []
    cols = set()
    for group in groups:
        if group is None:
            return None
        rows, qtype = group
        cols.add((qtype, rows.shape[1]))
        if runs and runs[-1][1] == qtype:
            runs[-1][0].append(rows)
        else:
            runs.append(([rows], qtype))
    if not runs:
        return None
    widths = {nbytes // block_geometry(q)[1] * block_geometry(q)[0] for q, nbytes in cols}
    if len(widths) != 1:
        raise ValueError(f"the groups' rows hold different numbers of values: {sorted(widths)}")
    parts = tuple((torch.cat(r).to(device).contiguous(), q) for r, q in runs)
    return GgufMatrix(parts, widths.pop())


def split_gate_rows(group: RowGroup, heads: int) -> tuple[RowGroup, RowGroup]:
    """A gated attention's q projection's rows (per head its query rows, then its output
    gate's: Qwen3-Next) as (the queries', the gates'), as `dense._split_gates` splits the
    dequantized matrix."""
    rows, qtype = group
    per = rows.reshape(heads, 2, -1, rows.shape[-1])
    queries, gates = (per[:, j].reshape(-1, rows.shape[-1]) for j in (0, 1))
    return (queries, qtype), (gates, qtype)
