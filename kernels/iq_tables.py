"""The lookup tables of llama.cpp's i-quants as one byte buffer per device, which the
kernels' tile decoder (`kernels.gemv._dequant_tile`) indexes.

Layout (byte offsets, mirrored as constants in `kernels.gemv`):
    IQ3_S_GRID  0     512 grid points x 4 values (odd 1..15), uint8
    IQ4_VALUES  2048  the 16 non-linear IQ4_NL / IQ4_XS levels, int8 as two's complement

The values come from the `gguf` package (its ports of llama.cpp's tables), not copied here.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import quants as gguf_quants

IQ3_S_GRID, IQ4_VALUES, SIZE = 0, 2048, 2064


@functools.cache
def _host() -> torch.Tensor:
    gguf_quants.IQ3_S.init_grid()
    grid = np.asarray(gguf_quants.IQ3_S.grid).reshape(512, 4)
    values = np.array(gguf_quants.IQ4_NL.kvalues, dtype=np.int8).view(np.uint8)
    out = np.concatenate([grid.astype(np.uint8).reshape(-1), values])
    assert out.size == SIZE
    return torch.from_numpy(out)


@functools.cache
def _on(device: torch.device) -> torch.Tensor:
    return _host().to(device)


def iq_tables(device: torch.device) -> torch.Tensor:
    """uint8 [SIZE] on `device` (one copy per device, kept for the process)."""
    return _on(torch.device(device))
