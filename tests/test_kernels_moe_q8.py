"""The fused MoE kernels' int8 dots (`kernels.experts.moe_dots_q8`) against their references."""

from __future__ import annotations

import pytest
import torch

from kernels.experts.moe import (
    ExpertFormat,
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    split_q6_k,
    unsplit_q6_k,
)
from kernels.experts.moe_dots_q8 import (
    dequantize_q8_ref,
    q8_row_bytes,
    quantize_q8,
    quantize_q8_ref,
)
from kernels.formats.quant import QType
from tests.test_kernels_moe import _mixed_case, _routed

Q4_K_M = (QType.Q4_K, QType.Q4_K, QType.Q6_K)


def test_quantize_q8_matches_its_definition() -> None:
    """Codes, scales per 32 and sums per 16, bit for bit; a block of zeros gets scale 0."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)) * 3
    x[1, 32:64] = 0.0
    got = quantize_q8(x)
    assert got.shape == (3, q8_row_bytes(256)) and torch.equal(got, quantize_q8_ref(x))
    back = dequantize_q8_ref(got, 256)
    assert (back - x).abs().max() <= x.abs().max() / 254 + 1e-6
    assert torch.equal(back[1, 32:64], torch.zeros(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_row_bytes(48)


@pytest.mark.parametrize(("t", "super_blocks"), [(1, 1), (3, 2)])
def test_int8_dots_match_reference(t: int, super_blocks: int) -> None:
    """Q4_K gate/up and Q6_K down in int8 (one token alone, and three sharing experts, two
    super-blocks a step over 768 columns: the last step masked): the reference that rounds
    each projection's input to its Q8 row, to float32 rounding; near the float32 kernels."""
    x, _, _, table, experts = _mixed_case(Q4_K_M, 1, 2, 3, 768, 256, "cpu")
    x = torch.randn(t, 768, generator=torch.Generator().manual_seed(t))
    ids, weights = _routed(t, 2, 3, seed=t)
    fmt = ExpertFormat(*Q4_K_M)
    cfg = MoeConfig(block_n=128, super_blocks=super_blocks, int8_dots=True)
    got = fused_moe(x, ids, weights, table, 256, cfg, aligned=True, fmt=fmt)
    ref = fused_moe_ref(x, ids, weights, experts, int8=(True, True, True))
    assert (got - ref).norm() / ref.norm() < 1e-4
    exact = fused_moe_ref(x, ids, weights, experts)
    assert (got - exact).norm() / exact.norm() < 3e-2  # the activations' 8-bit rounding
    for i in range(t):  # each token's output alone is its output in the batch
        alone = fused_moe(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], table, 256, cfg,
                          aligned=True, fmt=fmt)  # fmt: skip
        assert torch.equal(got[i : i + 1], alone), f"token {i} differs from its output alone"


@pytest.mark.parametrize(
    "mix",
    [(QType.Q5_K, QType.Q8_0, QType.Q8_0), (QType.Q5_K, QType.Q5_K, QType.Q5_K)],
    ids=["q5_k-q8_0-q8_0", "q5_k-q5_k-q5_k"],
)
def test_int8_dots_of_q5_k_and_q8_0(mix: tuple[QType, QType, QType]) -> None:
    """Q5_K (its fifth bits OR-ed into the nibble words; gate and up of one type dotted in
    one pass) and Q8_0 (blocks read as 16-bit halves) through the int8 dots: the Q8-rounded
    reference, to float32 rounding."""
    x, ids, weights, table, experts = _mixed_case(mix, 2, 2, 3, 512, 256, "cpu")
    cfg = MoeConfig(block_n=128, int8_dots=True)
    got = fused_moe(x, ids, weights, table, 256, cfg, aligned=True, fmt=ExpertFormat(*mix))
    ref = fused_moe_ref(x, ids, weights, experts, int8=(True, True, True))
    assert (got - ref).norm() / ref.norm() < 1e-4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_split_q6_k_reads_as_the_blocks_do(device: str) -> None:
    """Q6_K down in the split layout (codes, then scales, then d: aligned words) gives the
    int8 dots of the blocks bit for bit, over three super-blocks a row (a step of two masked);
    the layout is the blocks' bytes rearranged; float dots refuse it."""
    h = 256 if device == "cpu" else 2048
    x, ids, weights, table, experts = _mixed_case(Q4_K_M, 3, 2, 3, h, 768, device)
    _, _, _, split_table, _ = _mixed_case(Q4_K_M, 3, 2, 3, h, 768, device, q6_k_split=True)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    cfg = MoeConfig(block_n=64 if device == "cpu" else 4, super_blocks=2, int8_dots=True)
    blocks = fused_moe(x, ids, weights, table, 768, cfg, aligned=True, fmt=ExpertFormat(*Q4_K_M))
    fmt = ExpertFormat(*Q4_K_M, q6_k_split=True)
    split = fused_moe(x, ids, weights, split_table, 768, cfg, aligned=True, fmt=fmt)
    assert torch.equal(split, blocks)
    down = experts[0][2].data
    assert torch.equal(unsplit_q6_k(split_q6_k(down), h, 768), down)
    assert split_q6_k(down).numel() == down.numel()
    with pytest.raises(ValueError, match="split Q6_K"):
        fused_moe(x, ids, weights, split_table, 768, MoeConfig(), aligned=True, fmt=fmt)


def test_int8_dots_only_where_aligned_and_typed() -> None:
    """Unaligned blobs and types without an int8 reader stay on the float32 dots."""
    x, ids, weights, table, experts = _mixed_case(Q4_K_M, 2, 2, 3, 256, 256, "cpu")
    cfg = MoeConfig(block_n=128, int8_dots=True)
    got = fused_moe(x, ids, weights, table, 256, cfg, aligned=False, fmt=ExpertFormat(*Q4_K_M))
    ref = fused_moe_ref(x, ids, weights, experts)
    assert (got - ref).norm() / ref.norm() < 1e-5
    fmt = ExpertFormat(QType.Q4_K, QType.Q4_K, QType.Q6_K)
    assert fmt.int8(QType.Q4_K, cfg, True) and not fmt.int8(QType.Q4_0, cfg, True)
    assert not fmt.int8(QType.Q4_K, MoeConfig(), True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize(
    "cfg",
    [MoeConfig(int8_dots=True),
     MoeConfig(block_n=2, super_blocks=4, num_warps=1, int8_dots=True, group_pairs=False),
     MoeConfig(block_n=4, num_warps=1, int8_dots=True, group_pairs=False)],
    ids=["default", "sm90-gate-up", "sm90-down"],
)  # fmt: skip
def test_int8_dots_gpu(t: int, cfg: MoeConfig) -> None:
    """a3b's expert shapes in the Q4_K_M mix through dp4a: near the Q8-rounded reference,
    each token alone bit for bit its output in the batch."""
    x, _, _, table, experts = _mixed_case(Q4_K_M, 1, 8, 16, 2048, 768, "cuda")
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(t))
    ids, weights = _routed(t, 8, 16, seed=t)
    fmt = ExpertFormat(*Q4_K_M)
    xc, idc, wc = x.cuda(), ids.cuda(), weights.cuda()
    got = fused_moe(xc, idc, wc, table, 768, cfg, aligned=True, fmt=fmt)
    ref = fused_moe_ref(x, ids, weights, experts, int8=(True, True, True))
    err = (got.cpu() - ref).norm() / ref.norm()
    assert err < 1e-3, f"relative error {err:.2e}"
    for i in range(t):
        alone = fused_moe(xc[i : i + 1], idc[i : i + 1], wc[i : i + 1], table, 768, cfg,
                          aligned=True, fmt=fmt)  # fmt: skip
        assert torch.equal(got[i : i + 1], alone), f"token {i} differs from its output alone"
