"""Paced pinning with a real mlock, inside this process's RLIMIT_MEMLOCK."""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path

import pytest
import torch

from stratad.model.spec import ExpertUnit
from stratad.store.tiers.lock import LockChoice, LockError, MlockLocker, NoLocker, choose_locker
from stratad.store.tiers.memory import ResidentRAM
from stratad.store.tiers.pinning import Pinner, PinProgress, PinSettings
from tests.test_store_fakes import FakeSource

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LOGGER = "stratad.store"


def vm_locked() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * KiB
    raise AssertionError("no VmLck in /proc/self/status")


def lockable_bytes() -> int:
    """What this test may lock: 3/4 of what RLIMIT_MEMLOCK leaves, at most 4 MiB."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    room = 64 * MiB if soft == resource.RLIM_INFINITY else soft - vm_locked()
    assert room >= MiB, f"RLIMIT_MEMLOCK leaves {room} bytes: too little for the pinning test"
    return min(4 * MiB, room * 3 // 4)


def resident(source: FakeSource, budget: int) -> ResidentRAM:
    units = [
        ExpertUnit(layer, e) for e in range(source.n_experts) for layer in range(source.n_layers)
    ]
    stride = source.layouts[0].stride
    units = units[: budget // stride]
    return ResidentRAM(units, [stride] * len(units))


def test_paced_mlock_respects_chunk_and_rate_caps(caplog: pytest.LogCaptureFixture) -> None:
    source = FakeSource(n_layers=4, n_experts=64)
    ram = resident(source, lockable_bytes())
    chunk, rate = 256 * KiB, 8e6  # about 0.4 s for the whole set
    seen: list[tuple[float, PinProgress]] = []
    pinner = Pinner(
        ram,
        source,
        LockChoice(MlockLocker(), None),
        PinSettings(chunk, rate),
        on_progress=lambda p: seen.append((time.monotonic(), p)),
    )
    locked_before = vm_locked()
    caplog.set_level(logging.INFO, logger=LOGGER)
    t0 = time.monotonic()
    pinner.start()
    assert pinner.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert pinner.error is None and not pinner.failed

    # Progress reaches 100%, chunk by chunk, and no chunk is larger than the cap.
    last = seen[-1][1]
    assert (last.pinned_bytes, last.chunks_done, last.fraction, last.eta_s) == (
        ram.nbytes,
        last.chunks_total,
        1.0,
        0.0,
    )
    sizes = [
        b.pinned_bytes - a.pinned_bytes for (_, a), (_, b) in zip(seen, seen[1:], strict=False)
    ]
    assert len(seen) == len(ram.chunks(chunk)) >= 8
    assert max([seen[0][1].pinned_bytes, *sizes]) <= chunk
    # The rate cap, measured from outside: whenever a chunk ends, at most the bytes that the
    # cap allows since the start have been pinned; so the whole set took at least size / cap.
    for t, done in seen:
        assert done.pinned_bytes <= rate * (t - t0)
    assert ram.nbytes / elapsed <= rate * 1.02

    # Really locked (the kernel's count), and every blob is in place.
    assert vm_locked() - locked_before >= ram.nbytes
    assert all(ram.ready)
    for unit in ram.units[:: max(1, len(ram) // 8)]:
        view = ram.view(unit)
        assert view is not None
        assert torch.equal(view[: source.layouts[0].nbytes], source.blob(unit.layer, unit.expert))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"pinning the resident set: {len(ram)} experts,")
    assert "via mlock, in" in messages[0] and "at <= 0.01 GB/s" in messages[0]
    assert messages[-1].startswith(f"pinned {len(ram)} experts")
    assert messages[-1].endswith("the resident set is page-locked (mlock)")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    ram.close()
    assert vm_locked() == locked_before


def test_nothing_to_pin_finishes_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Every expert in VRAM: the plan keeps no RAM copies, and the pinner says so and is
    done (the daemon's readiness waits on it)."""
    source = FakeSource(n_layers=2, n_experts=4)
    ram = resident(source, 0)
    pinner = Pinner(ram, source, LockChoice(MlockLocker(), None), PinSettings(256 * KiB, 8e6))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        pinner.start()
        assert pinner.wait(timeout=5) and pinner.error is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ["pinning: the plan keeps no RAM copies, nothing to pin"]
    ram.close()


def test_unpaced_is_only_bounded_by_the_work() -> None:
    source = FakeSource(n_layers=4, n_experts=64)
    ram = resident(source, lockable_bytes())
    pinner = Pinner(ram, source, LockChoice(MlockLocker(), None), PinSettings(256 * KiB, 0))
    start = time.monotonic()
    pinner.start()
    assert pinner.wait(timeout=30)
    assert time.monotonic() - start < ram.nbytes / 8e6 / 2  # well under the paced run's time
    assert pinner.progress.fraction == 1.0
    ram.close()


def test_memlock_limit_too_small_falls_back_to_plain_ram_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    choice = choose_locker("auto", torch.device("cpu"), GiB, memlock=(8 * MiB, False))
    assert isinstance(choice.locker, NoLocker)
    assert choice.warning == (
        "cannot page-lock the resident set: RLIMIT_MEMLOCK is 8.0 MiB and the plan holds"
        " 1.00 GiB; it stays in plain RAM, where the kernel may swap it out (raise the limit:"
        " LimitMEMLOCK=infinity in the unit, `ulimit -l`, or the container's memlock ulimit)"
    )
    # CAP_IPC_LOCK (or an unlimited RLIMIT_MEMLOCK) lifts the limit; `none` is a choice, quiet.
    assert (
        choose_locker("auto", torch.device("cpu"), GiB, memlock=(8 * MiB, True)).locker.name
        == "mlock"
    )
    assert (
        choose_locker("auto", torch.device("cpu"), GiB, memlock=(None, False)).locker.name
        == "mlock"
    )
    assert choose_locker("none", torch.device("cpu"), GiB).warning is None

    source = FakeSource(n_layers=2, n_experts=8)
    ram = resident(source, MiB)
    caplog.set_level(logging.INFO, logger=LOGGER)
    pinner = Pinner(ram, source, choice, PinSettings(128 * KiB, 0))
    pinner.start()
    assert pinner.wait(timeout=30) and all(ram.ready)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [choice.warning]
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith("the resident set is in plain RAM (not page-locked)")
    )
    ram.close()


class _FailsAfterOne:
    """A locker that locks one chunk, then hits the limit (what mlock does at RLIMIT)."""

    name, locks, gpu_registered = "mlock", True, False

    def __init__(self) -> None:
        self.calls = 0

    def lock(self, ptr: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls > 1:
            raise LockError(12, "mlock of 131,072 bytes failed: Cannot allocate memory")

    def unlock(self, ptr: int, nbytes: int) -> None:
        pass


def test_lock_failure_midway_warns_once_and_finishes(caplog: pytest.LogCaptureFixture) -> None:
    source = FakeSource(n_layers=2, n_experts=16)
    ram = resident(source, MiB)
    locker = _FailsAfterOne()
    caplog.set_level(logging.INFO, logger=LOGGER)
    pinner = Pinner(ram, source, LockChoice(locker, None), PinSettings(128 * KiB, 0))
    pinner.start()
    assert pinner.wait(timeout=30)
    assert locker.calls == 2 and pinner.progress.fraction == 1.0 and all(ram.ready)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "cannot page-lock the resident set beyond 0.1 MiB (mlock of 131,072 bytes failed"
    )
    assert "the rest stays in plain RAM" in warnings[0]
    ram.close()
