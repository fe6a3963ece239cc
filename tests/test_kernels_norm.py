"""RMSNorm and the residual add fused with it against their torch references; the
reference against the textbook formula."""

from __future__ import annotations

import pytest
import torch

from kernels.layers.norm import NormConfig, add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from tests.kernel_cases import DEVICE, FLOATS, TOL, randn


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("rows", "dim"), [(1, 8), (3, 100), (5, 256)])
@pytest.mark.parametrize("block_d", [4096, 32])  # one pass, or several steps across a row
def test_rmsnorm(rows: int, dim: int, dtype: torch.dtype, block_d: int) -> None:
    x = randn(rows, dim, dtype=dtype, seed=dim) * 3
    w = randn(dim, dtype=dtype, seed=1)
    out = rmsnorm(x, w, 1e-6, NormConfig(block_d=block_d))
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rmsnorm_ref(x, w, 1e-6), **TOL[dtype])


def test_rmsnorm_reference_and_leading_dims() -> None:
    x = randn(2, 3, 40, seed=2)
    w = randn(40, seed=3)
    textbook = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(rmsnorm_ref(x, w, 1e-5), textbook)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), textbook)
    # eps matters on a zero row: no NaN, just zeros.
    assert torch.equal(
        rmsnorm(torch.zeros(1, 40, device=DEVICE), w, 1e-5), torch.zeros(1, 40, device=DEVICE)
    )
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, w[:39], 1e-5)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("rows", "parts", "dim"), [(1, 8, 64), (3, 1, 100), (2, 3, 256)])
def test_add_rmsnorm(rows: int, parts: int, dim: int, dtype: torch.dtype) -> None:
    """The residual add of a block's parts (float32 slot outputs, or one part in the stream's
    dtype) fused with the next norm, against the reference and against the unfused ops."""
    x = randn(rows, dim, dtype=dtype, seed=dim)
    w = randn(dim, dtype=dtype, seed=2)
    p = randn(rows, parts, dim, seed=parts) if parts > 1 else randn(rows, 1, dim, dtype=dtype)
    total, normed = add_rmsnorm(x, p, w, 1e-6)
    want_total, want_normed = add_rmsnorm_ref(x, p, w, 1e-6)
    assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == x.shape
    torch.testing.assert_close(total, want_total, **TOL[dtype])
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])
    torch.testing.assert_close(normed, rmsnorm(total, w, 1e-6), **TOL[dtype])  # the sum it kept


def test_add_rmsnorm_rejects_bad_shapes() -> None:
    x, w = randn(2, 32), randn(32)
    with pytest.raises(ValueError, match=r"\[T, P, D\]"):
        add_rmsnorm(x, randn(2, 32), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm(x, randn(2, 1, 32), w[:31], 1e-6)


@pytest.mark.gpu
def test_norm_kernels_real_shapes_gpu() -> None:
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), **TOL[torch.bfloat16])
    parts = torch.randn(8, 8, 4096, device="cuda")
    for got, want in zip(add_rmsnorm(x, parts, w, 1e-6), add_rmsnorm_ref(x, parts, w, 1e-6),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
