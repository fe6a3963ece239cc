"""Decode's dense projection kernel against its torch reference, and the reference against
torch's own linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as fn

from kernels.layers.linear import LinearConfig, decode_linear, decode_linear_ref, reduction_step
from tests.kernel_cases import FLOATS, TOL, randn

# Reductions of a few hundred products: half outputs differ by a rounding or two.
SUM_TOL = {**TOL, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 64, 256), (3, 20, 100), (8, 33, 64)])
@pytest.mark.parametrize(
    "config",
    [LinearConfig(block_n=8, block_k=64), LinearConfig(block_n=3, block_k=16)],
    ids=["even", "ragged"],
)
def test_decode_linear(
    tokens: int, n: int, k: int, dtype: torch.dtype, config: LinearConfig
) -> None:
    x = randn(tokens, k, dtype=dtype, seed=k)
    w = randn(n, k, dtype=dtype, seed=n) / k**0.5
    bias = randn(n, dtype=dtype, seed=3)
    for b in (None, bias):
        out = decode_linear(x, w, b, config)
        assert out.dtype == dtype and out.shape == (tokens, n)
        torch.testing.assert_close(out, decode_linear_ref(x, w, b), **SUM_TOL[dtype])


def test_a_batch_keeps_the_one_token_tile() -> None:
    """T tokens take a reduction step T times shorter (the partial sums stay the tile tuned for
    one token), down to 16 columns; the answer is the same (5 tokens, a 2048 step, 300
    columns: ragged at the batch's step of 256)."""
    assert [reduction_step(2048, t) for t in (1, 2, 8)] == [2048, 1024, 256]
    assert reduction_step(64, 8) == 16
    x, w = randn(5, 300, seed=7), randn(24, 300, seed=8) / 300**0.5
    out = decode_linear(x, w, config=LinearConfig(block_n=4, block_k=2048))
    torch.testing.assert_close(out, decode_linear_ref(x, w), **SUM_TOL[torch.float32])


def test_decode_linear_reference_and_views() -> None:
    """The reference is torch's linear; a weight that is a row slice of a larger matrix,
    a strided x and a strided bias give torch's answer."""
    x = randn(2, 48, seed=1)
    w = randn(40, 48, seed=2)
    bias = randn(40, seed=3)
    torch.testing.assert_close(decode_linear_ref(x, w, bias), fn.linear(x, w, bias))
    strided_bias = randn(80, seed=5)[::2]  # a bias with stride 2
    out = decode_linear(x, w, strided_bias)
    torch.testing.assert_close(out, fn.linear(x, w, strided_bias), **SUM_TOL[torch.float32])
    rows = w[8:24]  # strides of the parent
    wide = randn(2, 96, seed=4)[:, ::2]  # x with a non-unit stride
    out = decode_linear(wide, rows)
    torch.testing.assert_close(out, fn.linear(wide, rows), **SUM_TOL[torch.float32])


def test_decode_linear_checks() -> None:
    x, w = randn(1, 32), randn(16, 32)
    with pytest.raises(ValueError, match=r"expected x \[T, K\]"):
        decode_linear(x, randn(16, 31))
    with pytest.raises(ValueError, match="at most 8"):
        decode_linear(randn(9, 32), w)
    with pytest.raises(ValueError, match="bias"):
        decode_linear(x, w, randn(15))
    with pytest.raises(ValueError, match="contiguous K"):
        decode_linear(x, randn(32, 16).T)
    with pytest.raises(ValueError, match="power of two"):
        decode_linear(x, w, config=LinearConfig(block_k=48))
    assert decode_linear(randn(0, 32), w).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(5120, 2048), (2048, 4096), (128, 2048), (49152, 2048)])
def test_decode_linear_real_shapes_gpu(n: int, k: int) -> None:
    """a3b's qkv, o, router and output-head shapes against cuBLAS, in bfloat16."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    torch.testing.assert_close(decode_linear(x, w), fn.linear(x, w), **TOL[torch.bfloat16])
