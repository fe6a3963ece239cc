"""The fused MoE kernel (experts found through an address table) against its reference."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kernels.moe import (
    expert_table,
    fused_moe,
    fused_moe_ref,
    split_q4_0,
    split_q4_0_ok,
    unsplit_q4_0,
)
from kernels.quant import QTensor, QType


def _q4_0(rows: int, cols: int, gen: torch.Generator, device: str) -> QTensor:
    values = torch.randn(rows, cols, generator=gen) / cols**0.5
    raw = gguf_quants.quantize(values.numpy(), GGMLQuantizationType.Q4_0)
    data = torch.from_numpy(raw).to(device)
    return QTensor(data, QType.Q4_0, (rows, cols))


def _case(t: int, k: int, e: int, h: int, f: int, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    experts = [
        (_q4_0(f, h, gen, device), _q4_0(f, h, gen, device), _q4_0(h, f, gen, device))
        for _ in range(e)
    ]
    x = torch.randn(t, h, generator=gen).to(device)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    weights = torch.rand(t, k, generator=gen).to(device)
    split = [tuple(split_q4_0(w.data) for w in triple) for triple in experts]
    table = expert_table(split).to(device)  # type: ignore[arg-type]
    _KEEP.append(split)  # the table holds raw addresses: keep the bytes alive
    return x, ids, weights, table, experts


_KEEP: list[object] = []


@pytest.mark.parametrize(
    ("t", "k", "e", "h", "f", "aligned"),
    [(1, 2, 4, 64, 96, False), (3, 2, 5, 96, 32, False), (2, 4, 8, 256, 160, True)],
)
def test_fused_moe_matches_reference(
    t: int, k: int, e: int, h: int, f: int, aligned: bool
) -> None:
    x, ids, weights, table, experts = _case(t, k, e, h, f, "cpu")
    got = fused_moe(x, ids, weights, table, f, aligned=aligned)  # each matrix a tensor
    ref = fused_moe_ref(x, ids, weights, experts)
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_mixed_tiers_same_result() -> None:
    """Half the experts in one buffer, half in a copy elsewhere: same output."""
    x, ids, weights, table, experts = _case(2, 2, 4, 64, 64, "cpu", seed=3)
    a = [tuple(split_q4_0(w.data) for w in triple) for triple in experts]
    b = [tuple(t.clone() for t in triple) for triple in a]
    mixed = expert_table([b[i] if i % 2 else a[i] for i in range(len(a))])  # type: ignore[misc]
    assert torch.equal(fused_moe(x, ids, weights, table, 64), fused_moe(x, ids, weights, mixed, 64))


def test_split_layout_round_trip() -> None:
    gen = torch.Generator().manual_seed(2)
    w = _q4_0(96, 160, gen, "cpu")
    split = split_q4_0(w.data)
    assert split.numel() == w.data.numel() and split_q4_0_ok(96, 160)
    assert torch.equal(unsplit_q4_0(split, 96, 160), w.data)
    assert not split_q4_0_ok(3, 32)  # 6 bytes of scales: the words would be misaligned


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [False, True])
def test_fused_moe_gpu_real_shape_with_host_mapped_experts(aligned: bool) -> None:
    """a3b geometry; half the experts in VRAM, half read in place from pinned host RAM."""
    x, ids, weights, _, experts = _case(1, 8, 16, 2048, 768, "cpu", seed=5)
    split = [tuple(split_q4_0(w.data) for w in triple) for triple in experts]
    vram = [tuple(t.cuda() for t in triple) for triple in split[:8]]
    host = [tuple(t.pin_memory() for t in triple) for triple in split[8:]]
    table = expert_table(vram + host).cuda()
    got = fused_moe(x.cuda().bfloat16(), ids.cuda(), weights.cuda(), table, 768, aligned=aligned)
    ref = fused_moe_ref(x.bfloat16(), ids, weights, experts)
    err = (got.float().cpu() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_negative_ids_are_skipped() -> None:
    x, ids, weights, table, experts = _case(2, 3, 6, 64, 96, "cpu", seed=7)
    skip = ids.clone()
    skip[0, 1] = -1
    skip[1, 2] = -1
    kept = weights.clone()
    kept[0, 1] = 0.0
    kept[1, 2] = 0.0
    got = fused_moe(x, skip, weights, table, 96)
    ref = fused_moe_ref(x, ids, kept, experts)
    assert (got - ref).norm() / ref.norm() < 1e-5
