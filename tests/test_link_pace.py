"""The emulated slower link (benchmarks' --link-gbs): how long it waits, and on a GPU that
the step really waits that long."""

from __future__ import annotations

import time

import pytest
import torch

from kernels.experts.link_pace import ns_per_blob, pace_ns
from stratad.engine.offload.config import OffloadConfig
from stratad.engine.offload.cpu_misses import balanced_frac


def _table(n: int, base: int) -> torch.Tensor:
    rows = torch.arange(n, dtype=torch.int64)[:, None] * 4096 + base
    return rows + torch.tensor([0, 1024, 2048])


def test_wait_per_missed_blob() -> None:
    # experts 0-3 in RAM (the span), 4-7 in VRAM; negative ids are skipped
    table = torch.cat([_table(4, 1 << 20), _table(4, 1 << 30)])
    span = (1 << 20, (1 << 20) + 4 * 4096)
    ids = torch.tensor([[0, 5, 3, -1], [1, 6, 7, 2]])
    assert pace_ns(ids, table, span, 1000) == 4000
    # 2.5 MiB at 25 instead of 40 GB/s: 39.3 us more per blob
    assert ns_per_blob(2.5 * 2**20, 25e9, 40e9) == round(2.5 * 2**20 * (1 / 25e9 - 1 / 40e9) * 1e9)
    assert ns_per_blob(1e6, 50e9, 40e9) == 0  # never faster than the copy itself
    with pytest.raises(ValueError):
        ns_per_blob(1e6, 0, 40e9)


def test_paced_link_needs_the_plain_copy() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        OffloadConfig(expert_vram_bytes=0, link_wait_ns_per_blob=10, prefetch=True)
    with pytest.raises(ValueError, match="gpu_miss"):
        OffloadConfig(expert_vram_bytes=0, link_wait_ns_per_blob=10, gpu_miss="in_place")


def test_balanced_split() -> None:
    assert balanced_frac(30e9, 25e9) == round(1 - 30 / 55, 2)  # both finish together
    assert balanced_frac(0.5e9, 55e9) == 1.0  # a CPU share under 10%: not worth the syncs


@pytest.mark.gpu
def test_pace_waits_on_the_gpu() -> None:
    from kernels.experts.link_pace import pace_link

    table = torch.cat([_table(4, 1 << 20), _table(4, 1 << 30)]).cuda()
    span = (1 << 20, (1 << 20) + 4 * 4096)
    ids = torch.tensor([[0, 5, 3, 1]], dtype=torch.int32).cuda()
    pace_link(ids, table, span, 2_000_000)  # compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pace_link(ids, table, span, 2_000_000)  # 3 missed blobs: 6 ms
    torch.cuda.synchronize()
    assert 0.006 <= time.perf_counter() - t0 < 0.05
