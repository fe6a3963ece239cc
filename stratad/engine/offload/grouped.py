"""Grouped SwiGLU for prefill: rows already sorted by expert, one GEMM per projection."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as fn

log = logging.getLogger("stratad.engine")


def grouped_swiglu(
    xs: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of rows grouped by expert: xs [N, H] with counts[e] rows for expert e, in order.

    One grouped GEMM per projection where torch has one for this device and dtype; else a
    loop over the experts that have rows.
    """
    if _grouped_mm_ok(xs):
        try:
            offs = counts.cumsum(0).to(torch.int32)
            g = torch._grouped_mm(xs, gate.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(xs, up.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(fn.silu(g) * u, down.transpose(-2, -1), offs=offs)
        except (RuntimeError, TypeError) as err:  # an older torch or an unsupported shape
            GROUPED_MM[0] = False
            log.warning("grouped GEMM unavailable (%s): prefill falls back to a loop", err)
    out = torch.empty((xs.shape[0], down.shape[1]), dtype=xs.dtype, device=xs.device)
    begin = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            x = xs[begin : begin + n]
            out[begin : begin + n] = (fn.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T
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
