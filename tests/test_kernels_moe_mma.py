"""The expert-major tensor-core MoE (`kernels.experts.moe_mma`) against its references."""

from __future__ import annotations

import pytest
import torch

from kernels.experts.moe import ExpertFormat, MoeConfig, fused_moe, fused_moe_ref
from kernels.formats.quant import QType
from tests.test_kernels_moe import _mixed_case, _routed

Q4_K_M = (QType.Q4_K, QType.Q4_K, QType.Q6_K)
Q4_K_DOWN = (QType.Q4_K, QType.Q4_K, QType.Q4_K)
MMA = MoeConfig(tensor_cores=True, tensor_core_rows=128)


def _case(mix: tuple[QType, QType, QType], t: int, device: str):  # type: ignore[no-untyped-def]
    """Three experts of 512 columns (two super-blocks) and 256 rows, t tokens routed to two
    each: with t > 1 tokens share experts."""
    _, _, _, table, experts = _mixed_case(mix, 1, 2, 3, 512, 256, device)
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(t)).to(device)
    ids, weights = _routed(t, 2, 3, seed=t)
    return x, ids.to(device), weights.to(device), table, experts


@pytest.mark.parametrize("mix", [Q4_K_M, Q4_K_DOWN], ids=["q6_k-down", "q4_k-down"])
def test_tensor_cores_match_reference(mix: tuple[QType, QType, QType]) -> None:
    """Five tokens over three experts (groups of up to five members, some experts shared by
    all): the reference that rounds each projection's input to its Q8 row, to float32
    rounding; and the row dots' result to the same."""
    x, ids, weights, table, experts = _case(mix, 5, "cpu")
    fmt = ExpertFormat(*mix)
    got = fused_moe(x, ids, weights, table, 256, MMA, fmt=fmt)
    ref = fused_moe_ref(x, ids, weights, experts, int8=(True, True, True))
    assert (got - ref).norm() / ref.norm() < 1e-5
    rows = fused_moe(x, ids, weights, table, 256, MoeConfig(block_n=128, int8_dots=True),
                     aligned=True, fmt=fmt)  # fmt: skip
    assert (got - rows).norm() / rows.norm() < 1e-5


def test_a_token_is_the_same_in_any_step() -> None:
    """Each token's output alone, in the step, and in the step's tokens reversed: bit for
    bit the same (the integer dots are exact, each (row, token) summed in its own order)."""
    x, ids, weights, table, _ = _case(Q4_K_M, 4, "cpu")
    fmt = ExpertFormat(*Q4_K_M)
    got = fused_moe(x, ids, weights, table, 256, MMA, fmt=fmt)
    back = fused_moe(x.flip(0), ids.flip(0), weights.flip(0), table, 256, MMA, fmt=fmt)
    assert torch.equal(back.flip(0), got)
    for i in range(4):
        alone = fused_moe(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], table, 256, MMA,
                          fmt=fmt)  # fmt: skip
        assert torch.equal(alone, got[i : i + 1]), f"token {i} differs from its output alone"


def test_more_members_than_a_tile_and_skipped_slots() -> None:
    """Twenty tokens over three experts (more than the 16 columns of a tile per expert) with
    two slots skipped (id -1: computed elsewhere, they contribute zero)."""
    x, ids, weights, table, experts = _case(Q4_K_M, 20, "cpu")
    ids[3, 1] = -1
    ids[17, 0] = -1
    fmt = ExpertFormat(*Q4_K_M)
    got = fused_moe(x, ids, weights, table, 256, MMA, fmt=fmt)
    rows = fused_moe(x, ids, weights, table, 256, MoeConfig(block_n=128, int8_dots=True),
                     aligned=True, fmt=fmt)  # fmt: skip
    assert (got - rows).norm() / rows.norm() < 1e-5
    kept = ids.clamp(min=0)
    w = torch.where(ids < 0, torch.zeros_like(weights), weights)
    ref = fused_moe_ref(x, kept, w, experts, int8=(True, True, True))
    # one of the down inputs' Q8 codes rounds the other way in the reference (its float32
    # activation differs in the last place): a token off by 2e-3 of its norm
    assert (got - ref).norm() / ref.norm() < 1e-3


def test_tensor_cores_only_for_their_types_and_steps() -> None:
    """The switch, the least tokens and the readers' types decide; rows a power of two."""
    cfg = MoeConfig(tensor_cores=True, tensor_core_tokens=4)
    assert cfg.tensor_core_step(4, QType.Q4_K, QType.Q6_K)
    assert not cfg.tensor_core_step(3, QType.Q4_K, QType.Q6_K)
    assert not cfg.tensor_core_step(8, QType.Q4_K, QType.Q4_0)
    assert not MoeConfig().tensor_core_step(8, QType.Q4_K)
    with pytest.raises(ValueError, match="tensor_core_rows"):
        MoeConfig(tensor_core_rows=24)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 32])
def test_tensor_cores_gpu(t: int) -> None:
    """On the GPU, at a3b's shapes (2,048 columns, 768 rows, 128 experts, top 8): the Q8
    reference to float32 rounding, and each token alone equal to its output in the step."""
    _, _, _, table, experts = _mixed_case(Q4_K_M, 1, 8, 16, 2048, 768, "cuda")
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 2048, generator=gen).cuda()
    ids = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(t)]).cuda()
    weights = torch.rand(t, 8, generator=gen).cuda()
    fmt = ExpertFormat(*Q4_K_M)
    cfg = MoeConfig(tensor_cores=True)
    got = fused_moe(x, ids, weights, table, 768, cfg, fmt=fmt)
    ref = fused_moe_ref(x.cpu(), ids.cpu(), weights.cpu(), experts, int8=(True, True, True))
    assert (got.cpu() - ref).norm() / ref.norm() < 1e-4
    alone = fused_moe(x[:1], ids[:1], weights[:1], table, 768, cfg, fmt=fmt)
    assert torch.equal(alone, got[:1])
