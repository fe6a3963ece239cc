"""The lookup tables of llama.cpp's i-quants (and MXFP4's levels) as one byte buffer per device,
which the kernels' decoders (`kernels.layers.gemv._dequant_tile`, `kernels.formats.iq_decode`, the
CPU kernels) index.

Layout (byte offsets, mirrored as constants where the kernels read them):
    IQ3_S_GRID    0      512 grid points x 4 values (odd 1..15), uint8
    IQ4_VALUES    2048   the 16 non-linear IQ4_NL / IQ4_XS levels, int8 as two's complement
    IQ3_XXS_GRID  2064   256 x 4 (4..62), uint8
    IQ2_XXS_GRID  3088   256 x 8 (8, 25, 43), uint8
    IQ2_XS_GRID   5136   512 x 8, as IQ2_XXS's
    IQ2_S_GRID    9232   1024 x 8, as IQ2_XXS's
    IQ1_S_GRID    17424  2048 x 8 (-1, 0, 1), int8 as two's complement
    KSIGNS        33808  128: 7 stored sign bits -> 8 (the 8th makes the count of minus
                         signs even), llama.cpp's ksigns_iq2xs
    MXFP4_VALUES  33936  the 16 MXFP4 levels (E2M1 doubled), int8 as two's complement

The compiled CPU kernels read the tables at these offsets (#defines in decode*.h): append, do
not move. The values come from the `gguf` package (its ports of llama.cpp's tables), not copied
here.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import quants as gguf_quants

IQ3_S_GRID, IQ4_VALUES, IQ3_XXS_GRID, IQ2_XXS_GRID = 0, 2048, 2064, 3088
IQ2_XS_GRID, IQ2_S_GRID, IQ1_S_GRID, KSIGNS = 5136, 9232, 17424, 33808
MXFP4_VALUES, SIZE = 33936, 33952


def _grid(name: str) -> np.ndarray:
    """An i-quant's grid, flattened, as bytes (negative values as two's complement)."""
    quant = getattr(gguf_quants, name)
    quant.init_grid()  # gguf-py decodes its packed table on first use
    return np.asarray(quant.grid).reshape(-1).astype(np.int8).view(np.uint8)


@functools.cache
def _host() -> torch.Tensor:
    parts = [
        (IQ3_S_GRID, _grid("IQ3_S")),
        (IQ4_VALUES, np.array(gguf_quants.IQ4_NL.kvalues, dtype=np.int8).view(np.uint8)),
        (IQ3_XXS_GRID, _grid("IQ3_XXS")),
        (IQ2_XXS_GRID, _grid("IQ2_XXS")),
        (IQ2_XS_GRID, _grid("IQ2_XS")),
        (IQ2_S_GRID, _grid("IQ2_S")),
        (IQ1_S_GRID, _grid("IQ1_S")),
        (KSIGNS, np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)),
        (MXFP4_VALUES, np.array(gguf_quants.MXFP4.kvalues, dtype=np.int8).view(np.uint8)),
    ]
    assert [at for at, _ in parts] == list(np.cumsum([0] + [p.size for _, p in parts[:-1]]))
    out = np.concatenate([p for _, p in parts])
    assert out.size == SIZE
    return torch.from_numpy(out)


@functools.cache
def _on(device: torch.device) -> torch.Tensor:
    return _host().to(device)


def iq_tables(device: torch.device) -> torch.Tensor:
    """uint8 [SIZE] on `device` (one copy per device, kept for the process)."""
    return _on(torch.device(device))
