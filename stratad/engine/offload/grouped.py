"""Grouped gated experts for prefill: rows already sorted by expert, one GEMM per
projection; the model's activation (`stratad.model.graph.activation`) between them, and biases per
row where the experts have them (gpt-oss)."""

from __future__ import annotations

import logging

import torch

from stratad.model.graph.activation import SILU, Activation

log = logging.getLogger("stratad.engine")


def grouped_glu(
    xs: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    glu: Activation = SILU,
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gated experts of rows grouped by expert: xs [N, H] with counts[e] rows for expert e, in
    order; `glu(gate, up)` between the projections; `bias`: each row's gate and up [N, F] and
    down [N, H] biases (its expert's).

    One grouped GEMM per projection where torch has one for this device and dtype; else a
    loop over the experts that have rows.
    """

    def act(g: torch.Tensor, u: torch.Tensor, rows: slice) -> torch.Tensor:
        if bias is not None:
            g, u = g + bias[0][rows], u + bias[1][rows]
        return glu(g, u).to(xs.dtype)

    def out_bias(y: torch.Tensor, rows: slice) -> torch.Tensor:
        return y if bias is None else y + bias[2][rows]

    every = slice(0, xs.shape[0])
    if _grouped_mm_ok(xs):
        try:
            offs = counts.cumsum(0).to(torch.int32)
            g = torch._grouped_mm(xs, gate.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(xs, up.transpose(-2, -1), offs=offs)
            y = torch._grouped_mm(act(g, u, every), down.transpose(-2, -1), offs=offs)
            return out_bias(y, every).to(xs.dtype)
        except (RuntimeError, TypeError) as err:  # an older torch or an unsupported shape
            GROUPED_MM[0] = False
            log.warning("grouped GEMM unavailable (%s): prefill falls back to a loop", err)
    out = torch.empty((xs.shape[0], down.shape[1]), dtype=xs.dtype, device=xs.device)
    begin = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = slice(begin, begin + n)
            x = xs[rows]
            out[rows] = out_bias(act(x @ gate[e].T, x @ up[e].T, rows) @ down[e].T, rows)
            begin += n
    return out


def _grouped_mm_ok(xs: torch.Tensor) -> bool:
    return (
        xs.is_cuda
        and xs.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(xs.device)[0] >= 9
        and GROUPED_MM[0]
    )


GROUPED_MM = [True]  # switched off for the process if torch refuses the first call
