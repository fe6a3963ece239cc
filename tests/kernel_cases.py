"""What the small-kernel tests share: the device they run on, float dtypes, tolerances,
seeded inputs."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Tolerances: float32 results differ from the reference by summation order and libm vs
# libdevice (a few ulp); half-precision results by one rounding of the output.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)
