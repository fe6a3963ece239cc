"""The expert fetch (missed experts copied into VRAM staging) against its reference, and the
fused MoE kernel reading through what it returns."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kernels.experts.expert_fetch import FetchConfig, fetch_experts, fetch_experts_ref
from kernels.experts.moe import fused_moe, split_q4_0

SMALL = FetchConfig(chunk=256, block=16)  # several programs per blob even for tiny blobs
FEW = FetchConfig(chunk=256, block=16, programs=3)  # each program copies every third chunk


def _blobs(e: int, h: int, f: int, seed: int) -> torch.Tensor:
    """[E, blob bytes]: each expert's split-Q4_0 (gate | up | down), as the engine lays it."""
    gen = torch.Generator().manual_seed(seed)

    def q(rows: int, cols: int) -> torch.Tensor:
        values = (torch.randn(rows, cols, generator=gen) / cols**0.5).numpy()
        raw = gguf_quants.quantize(values, GGMLQuantizationType.Q4_0)
        return split_q4_0(torch.from_numpy(raw))

    return torch.stack([torch.cat([q(f, h), q(f, h), q(h, f)]) for _ in range(e)])


def _table(rows: list[torch.Tensor], gate_bytes: int) -> torch.Tensor:
    return torch.tensor(
        [[r.data_ptr(), r.data_ptr() + gate_bytes, r.data_ptr() + 2 * gate_bytes] for r in rows],
        dtype=torch.int64,
    )


def _setup(e: int, h: int, f: int, resident: set[int], seed: int = 0):  # type: ignore[no-untyped-def]
    host = _blobs(e, h, f, seed)
    vram = host.clone()  # stands for the VRAM slots: a separate buffer with the same bytes
    gate_bytes = f * (h // 32) * 18
    rows = [vram[i] if i in resident else host[i] for i in range(e)]
    lo = host.data_ptr()
    return host, vram, _table(rows, gate_bytes), (lo, lo + host.numel())


@pytest.mark.parametrize(
    ("t", "k", "config"), [(1, 4, SMALL), (3, 2, SMALL), (2, 3, FEW), (4, 3, SMALL)]
)
def test_fetch_copies_misses_and_keeps_hits(t: int, k: int, config: FetchConfig) -> None:
    """Each missed expert is copied once, into the row of the first pair routed to it, however
    many tokens share it; every pair's slot id names that row."""
    e, h, f = 6, 64, 96
    host, _, table, span = _setup(e, h, f, resident={1, 4}, seed=t)
    gen = torch.Generator().manual_seed(k)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[0, -1] = -1  # computed elsewhere
    staging = torch.zeros((t * k, host.shape[1] + 64), dtype=torch.uint8)
    slot_ids, step = fetch_experts(ids, table, span, staging, host.shape[1], config)
    want_ids, want_step = fetch_experts_ref(ids, table, span, staging.data_ptr(), staging.stride(0))
    assert torch.equal(slot_ids, want_ids)
    valid = want_ids.reshape(-1) >= 0
    assert torch.equal(step[valid], want_step[valid])
    flat = ids.reshape(-1).tolist()
    for s, ex in enumerate(flat):
        if ex >= 0 and ex not in {1, 4} and flat.index(ex) == s:  # a miss: copied whole, once
            assert torch.equal(staging[s, : host.shape[1]], host[ex])
        else:  # hits, skipped slots and the later sharers of a miss leave their row alone
            assert not staging[s].any()
    if t * k > e:  # more pairs than experts: some tokens share one, read through one row
        assert len({x for x in flat if x >= 0}) < sum(x >= 0 for x in flat)


def test_fused_moe_through_the_fetch_equals_in_place() -> None:
    e, h, f, t, k = 5, 64, 64, 2, 3
    host, _, table, span = _setup(e, h, f, resident={0, 3}, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[1, 0] = -1
    weights = torch.rand(t, k, generator=gen)
    staging = torch.empty((t * k, host.shape[1]), dtype=torch.uint8)
    slot_ids, step = fetch_experts(ids, table, span, staging, host.shape[1], SMALL)
    got = fused_moe(x, slot_ids, weights, step, f)
    assert torch.equal(got, fused_moe(x, ids, weights, table, f))


def test_fetch_rejects_bad_buffers() -> None:
    host, _, table, span = _setup(2, 32, 32, resident=set())
    ids = torch.zeros((1, 2), dtype=torch.int64)
    small = torch.empty((1, host.shape[1]), dtype=torch.uint8)
    with pytest.raises(ValueError, match="smaller than 2 blobs"):
        fetch_experts(ids, table, span, small, host.shape[1])
    with pytest.raises(ValueError, match="16-byte"):
        fetch_experts(ids, table, span, torch.empty((2, 4096), dtype=torch.uint8), 1000)
    with pytest.raises(ValueError, match=r"int64 \[E, 3\]"):
        fetch_experts(ids, table[:, :2], span, small, host.shape[1])


@pytest.mark.gpu
def test_fetch_gpu_real_shape_from_pinned_host() -> None:
    """a3b geometry: 16 experts, 8 pinned in host RAM, 8 in VRAM; one token routed to 8."""
    e, h, f = 16, 2048, 768
    host = _blobs(e, h, f, seed=9).pin_memory()
    vram = host.cuda()
    gate_bytes = f * (h // 32) * 18
    rows = [vram[i] if i % 2 else host[i] for i in range(e)]
    table = _table(rows, gate_bytes).cuda()
    span = (host.data_ptr(), host.data_ptr() + host.numel())
    ids = torch.arange(8, dtype=torch.int64).reshape(1, 8).cuda() * 2 % e
    staging = torch.empty((8, host.shape[1]), dtype=torch.uint8, device="cuda")
    slot_ids, step = fetch_experts(ids, table, span, staging, host.shape[1])
    torch.cuda.synchronize()
    for s, ex in enumerate(ids.reshape(-1).tolist()):
        if ex % 2 == 0:
            assert torch.equal(staging[s].cpu(), host[ex])
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(1, 8, device="cuda")
    got = fused_moe(x, slot_ids, weights, step, f)
    assert torch.equal(got, fused_moe(x, ids, weights, table, f))
