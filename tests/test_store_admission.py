"""Starting the store: the budget, the plan, admission with MemAvailable short, the coverage line.

The source is fake (blobs of 27 MiB that are never written), MemTotal, MemAvailable, the clock
and the bandwidths are injected, so every line an operator greps for is asserted verbatim.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import pytest
import torch

from stratad.config import Config, StoreConfig, apply_env
from stratad.env import Env
from stratad.store.placement.admission import EXIT_SHORT_RAM, AdmissionRefused
from stratad.store.placement.bandwidth import Bandwidths
from stratad.store.placement.plan import GiB, place
from stratad.store.placement.profile import profile_from_counts
from stratad.store.startup import daemon_reserves, open_store, plan_inputs
from stratad.store.store import ExpertStore
from tests.test_store_fakes import FakeSource

MiB = 1 << 20
LOGGER = "stratad.store"
# Per layer, expert e was routed 8 - e times: 36 routes per layer, 144 in all.
PROFILE = profile_from_counts([[8 - e for e in range(8)] for _ in range(4)])
BANDWIDTHS = Bandwidths(file_bps=2e9, copy_bps=20e9)
CONFIG = StoreConfig(
    expert_cache=0,
    resident_headroom_gib=1.0,
    reserve_runtime_gib=1.0,
    lock="none",
    pin_rate_gbps=0,
    admission_wait_s=10.0,
    admission_backoff_s=1.0,
)
# MemTotal 4 GiB - headroom 1 - runtime 1 - dense weights 1 = 1 GiB of budget: all 32 blobs
# (27 MiB each, 0.84 GiB) fit, and the plan needs 0.84 + 1 GiB of headroom available.


def source() -> FakeSource:
    src = FakeSource(n_layers=4, n_experts=8, hidden=4096, ffn=4096, touch=False)
    assert src.layouts[0].stride == 27 * MiB
    return src


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def start(config: StoreConfig, available: Iterator[int] | int, clock: FakeClock) -> ExpertStore:
    readings = iter([available] * 100) if isinstance(available, int) else available
    return open_store(
        config,
        source(),
        compute_device=torch.device("cpu"),
        profile=PROFILE,
        reserves=[("dense weights", GiB)],
        host_total=(4 * GiB, "MemTotal"),
        read_available=lambda: next(readings),
        bandwidths=BANDWIDTHS,
        sleep=clock.sleep,
        clock=clock,
    )


def messages(caplog: pytest.LogCaptureFixture, level: int | None = None) -> list[str]:
    return [r.getMessage() for r in caplog.records if level is None or r.levelno == level]


def full_plan_hash() -> str:
    src = source()
    return place(plan_inputs(src, PROFILE, 0, GiB)).hash


def test_full_coverage_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    store = start(CONFIG, 3 * GiB, clock)
    h = store.plan.hash
    assert h == full_plan_hash() and clock.sleeps == [] and not store.degraded
    assert store.budget is not None and store.budget.bytes == GiB
    assert messages(caplog)[:4] == [
        "resident budget 1.00 GiB = MemTotal 4.00 - resident_headroom_gib 1.00"
        " - reserve_runtime_gib 1.00 - dense weights 1.00 GiB",
        f"residency plan {h}: 0 experts start in VRAM (0.00 GiB), 32 keep a copy in RAM"
        " (0.84 of 1.00 GiB), 0 of 32 are read from the file only",
        "measured bandwidths: file read 2.00 GB/s, resident copy 20.00 GB/s",
        "coverage: 32 of 32 experts keep a copy in RAM or VRAM (100.0% of the routed mass);"
        f" none is read from the file [plan {h}]",
    ]
    assert [r.levelname for r in caplog.records if r.getMessage().startswith("coverage")] == [
        "INFO"
    ]
    assert not messages(caplog, logging.WARNING)
    assert store.pinner.wait(timeout=30) and store.pinner.progress.fraction == 1.0
    store.close()


def test_plan_does_not_depend_on_mem_available(caplog: pytest.LogCaptureFixture) -> None:
    """The upstream engine's coin flip: here two starts with different (sufficient)
    MemAvailable readings give the same plan, byte for byte."""
    hashes = []
    for available in (2 * GiB, 3 * GiB + 123_456_789):
        store = start(CONFIG, available, FakeClock())
        hashes.append(store.plan.hash)
        store.close()
    assert hashes == [full_plan_hash()] * 2


WANTED = "needs 1.84 GiB available (0.84 GiB resident + 1.00 GiB headroom)"


def test_short_ram_waits_with_backoff_then_refuses(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    config = msgspec.structs.replace(CONFIG, on_short_ram="refuse")
    with pytest.raises(AdmissionRefused) as err:
        start(config, int(1.5 * GiB), clock)
    h = full_plan_hash()
    assert clock.sleeps == [1.0, 2.0, 4.0, 3.0]  # doubling, bounded by admission_wait_s
    waits = [m for m in messages(caplog, logging.INFO) if m.startswith("waiting")]
    assert waits[0] == (
        f"waiting for RAM: the resident plan {h} {WANTED}, MemAvailable is 1.50 GiB;"
        " retrying in 1.0s (for up to 10s more)"
    )
    assert waits[-1].endswith("retrying in 3.0s (for up to 3s more)") and len(waits) == 4
    assert err.value.exit_code == EXIT_SHORT_RAM == 75
    assert str(err.value) == (
        f"refusing to start: after waiting 10s MemAvailable is 1.50 GiB, but the resident plan"
        f" {h} {WANTED}. Free RAM, lower store.resident_budget_gib, or set"
        ' store.on_short_ram = "degrade" to start with fewer resident experts'
    )
    assert messages(caplog, logging.ERROR) == [str(err.value)]
    assert not any(m.startswith("coverage") for m in messages(caplog))


def test_short_ram_that_frees_up_while_waiting_keeps_the_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    readings = iter([GiB, GiB, 2 * GiB])
    store = start(msgspec.structs.replace(CONFIG, on_short_ram="refuse"), readings, clock)
    assert store.plan.hash == full_plan_hash() and clock.sleeps == [1.0, 2.0]
    assert "RAM available after 3.0s: MemAvailable is 2.00 GiB" in messages(caplog)
    store.close()


def test_short_ram_degrades_to_a_smaller_deterministic_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = start(CONFIG, int(1.5 * GiB), FakeClock())
    plan = store.plan
    # MemAvailable 1.5 - headroom 1 = 0.5 GiB granted: 18 blobs of 27 MiB, hottest first.
    src = source()
    assert plan == place(plan_inputs(src, PROFILE, 0, GiB // 2))
    assert (len(plan.ram), plan.ram_budget) == (18, GiB // 2)
    assert store.degraded and store.bandwidths == BANDWIDTHS and store.counts == PROFILE.flat
    h, h_full = plan.hash, full_plan_hash()
    assert messages(caplog, logging.WARNING) == [
        f"running degraded: after waiting 10s MemAvailable is 1.50 GiB, but the resident plan"
        f" {h_full} {WANTED}; using plan {h} with a resident budget of 0.50 GiB (MemAvailable"
        " - headroom, rounded down to 0.25 GiB): 18 of 32 experts keep a copy in RAM or VRAM,"
        " expect up to 81% less prompt speed on long prompts",
        "coverage: 18 of 32 experts keep a copy in RAM or VRAM (77.8% of the routed mass); the"
        " other 14 (378.0 MiB) will be read from fake.pack/experts.bin when routed. At the"
        " measured 2.00 GB/s file read vs 20.00 GB/s resident copy, expect up to 81% less"
        " prompt speed on long prompts. Least covered layers: 2 (4/8), 3 (4/8), 0 (5/8). To"
        " cover them all, raise store.resident_budget_gib or lower store.resident_headroom_gib"
        f" (STRATA_RESIDENT_HEADROOM_GIB) [plan {h}]",
    ]
    assert not any(m.startswith("coverage") for m in messages(caplog, logging.INFO))
    store.close()
    # The same shortage gives the same degraded plan on the next start.
    again = start(CONFIG, int(1.5 * GiB) + 10 * MiB, FakeClock())
    assert again.plan.hash == h
    again.close()


def test_the_daemons_own_reserves_are_named() -> None:
    assert daemon_reserves(Config(), 3 * MiB) == [
        ("dense weights", 3 * MiB),
        ("server.conversation_cache_mib", 512 * MiB),
        ("server.pinned_prefix_mib", 256 * MiB),
    ]


def test_headroom_comes_from_the_environment() -> None:
    config = apply_env(Config(), Env.read({"STRATA_RESIDENT_HEADROOM_GIB": "7"}))
    assert config.store.resident_headroom_gib == 7.0
    assert apply_env(Config(), Env.read({})).store.resident_headroom_gib == 4.0
