"""The int8 dense GEMV (`kernels.layers.qlinear`) against its reference, per type."""

from __future__ import annotations

import pytest
import torch

from kernels.experts.moe_dots_q8 import quantize_q8
from kernels.formats.quant import QTensor, QType, quantize
from kernels.layers.qlinear import QLinearConfig, qlinear, qlinear_ref
from tests.sm90_compile import compile_case

TYPES = [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0]


def _weight(qtype: QType, n: int, k: int, device: str, seed: int = 0) -> QTensor:
    values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    return QTensor(quantize(values, qtype).reshape(n, -1).to(device), qtype, (n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_qlinear_matches_reference(qtype: QType) -> None:
    """Three tokens, 20 rows in blocks of 8 (the last masked), two super-blocks a step over
    512 columns: the Q8-rounded reference to float32 rounding; each token alone is its row
    of the batch, bit for bit, and so it is with more rows a program (the super-blocks a step
    set the order of a row's sums)."""
    w = _weight(qtype, 20, 512, "cpu")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    cfg = QLinearConfig(block_n=8, super_blocks=2)
    got = qlinear(x, w.data, qtype, cfg)
    ref = qlinear_ref(x, w)
    assert got.shape == (3, 20) and (got - ref).norm() / ref.norm() < 1e-5
    exact = x @ w.dequantize().t()
    assert (got - exact).norm() / exact.norm() < 3e-2  # the activation's 8-bit rounding
    for i in range(3):
        assert torch.equal(qlinear(x[i : i + 1], w.data, qtype, cfg), got[i : i + 1])
    assert torch.equal(qlinear(x, w.data, qtype, QLinearConfig(block_n=32, super_blocks=2)), got)
    x8 = quantize_q8(x)  # made once for several matrices: the same dots
    assert torch.equal(qlinear(x, w.data, qtype, cfg, x8), got)


def test_qlinear_compiles_for_sm90() -> None:
    """Every type's launch, the token loop and dp4a as PTX, compiles for an sm90 GPU."""
    out = compile_case("qlinear")
    assert out.count("_qlinear_kernel: ") == len(TYPES), out


def test_qlinear_refuses_what_it_cannot_read() -> None:
    w = _weight(QType.Q4_K, 4, 256, "cpu")
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="not Q4_0"):
        qlinear(x, w.data, QType.Q4_0)
    with pytest.raises(ValueError, match="rows of 512 values"):
        qlinear(torch.randn(1, 512), w.data, QType.Q4_K)
    with pytest.raises(ValueError, match="4-byte aligned"):
        flat = torch.zeros(w.data.numel() + 1, dtype=torch.uint8)
        flat[1:] = w.data.reshape(-1)
        qlinear(x, flat[1:].view(4, -1), QType.Q4_K)
    with pytest.raises(ValueError, match="power of two"):
        QLinearConfig(block_n=3)
    assert qlinear(x[:0], w.data, QType.Q4_K).shape == (0, 4)
    with pytest.raises(ValueError, match="Q8 rows"):
        qlinear(x, w.data, QType.Q4_K, x8=torch.zeros(1, 8, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_qlinear_gpu_real_shape(qtype: QType) -> None:
    """The a3b's o projection [2048, 4096] through dp4a: near the reference, batch-invariant."""
    w = _weight(qtype, 2048, 4096, "cuda")
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    got = qlinear(x, w.data, qtype)
    ref = qlinear_ref(x, w)
    err = (got.float().cpu() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"  # bf16 output rounding
    assert torch.equal(qlinear(x[2:3], w.data, qtype), got[2:3])
