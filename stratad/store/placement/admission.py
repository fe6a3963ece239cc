"""Admission at start: is the RAM the plan needs actually free right now?

The plan is sized from configuration and MemTotal, never from a momentary MemAvailable; but
the RAM must still be there when the resident set is pinned. If MemAvailable is short of the
plan plus the headroom, wait (another process may be exiting: a previous stratad, a build),
with backoff, for a bounded time, saying what we wait for. Then, as `store.on_short_ram` says,
refuse to start (exit code 75, EX_TEMPFAIL, with a message for `systemctl status`) or run with
a smaller plan, loudly. The smaller plan is deterministic too: the same function of the budget
actually granted, rounded down to a quarter GiB so that small jitter gives the same plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stratad.store.placement.plan import ResidencyPlan
from stratad.store.sizes import GiB

log = logging.getLogger("stratad.store")

EXIT_SHORT_RAM = 75  # EX_TEMPFAIL: RestartPreventExitStatus=75 stops systemd from looping

MemReader = Callable[[], int]


class AdmissionRefused(RuntimeError):
    exit_code = EXIT_SHORT_RAM


@dataclass(frozen=True)
class AdmissionPolicy:
    mode: Literal["refuse", "degrade"]
    wait_s: float  # how long to wait for the RAM before refusing or degrading
    backoff_s: float  # first retry interval; doubles up to backoff_max_s
    backoff_max_s: float
    headroom_bytes: int  # RAM left to the rest of the host on top of the plan
    step_bytes: int = GiB // 4  # a degraded budget is rounded down to this


@dataclass(frozen=True)
class Admission:
    plan: ResidencyPlan
    degraded: bool
    available: int  # MemAvailable at the decision
    waited_s: float


# --- reading the host's memory ------------------------------------------------------------


def read_meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def _cgroup(name: str, root: Path = Path("/sys/fs/cgroup")) -> str | None:
    try:
        return (root / name).read_text().strip()
    except OSError:
        return None


def cgroup_limit() -> int | None:
    """The cgroup v2 memory.max of this process's cgroup (containers, systemd MemoryMax=)."""
    raw = _cgroup("memory.max")
    return int(raw) if raw and raw != "max" else None


def mem_total() -> tuple[int, str]:
    """(bytes, what it is): MemTotal, or the cgroup limit when that is lower."""
    total = read_meminfo()["MemTotal"]
    limit = cgroup_limit()
    if limit is not None and limit < total:
        return limit, "cgroup memory.max"
    return total, "MemTotal"


def mem_available() -> int:
    """MemAvailable, or what the cgroup still allows when that is lower."""
    available = read_meminfo()["MemAvailable"]
    limit, current = cgroup_limit(), _cgroup("memory.current")
    if limit is not None and current is not None:
        stat = (_cgroup("memory.stat") or "").splitlines()
        fields = dict(line.split(maxsplit=1) for line in stat if " " in line)
        reclaimable = int(fields.get("inactive_file", 0))
        available = min(available, limit - int(current) + reclaimable)
    return available


# --- the decision -------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def admit(
    plan: ResidencyPlan,
    replan: Callable[[int], ResidencyPlan],
    policy: AdmissionPolicy,
    read_available: MemReader,
    *,
    cost: Callable[[ResidencyPlan], str] = lambda p: "",
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Admission:
    """The plan to run with. `replan(budget)` is the plan for a smaller RAM budget; `cost(p)`
    describes what a plan costs in coverage and speed (for the degraded WARNING)."""
    need = plan.ram_bytes + policy.headroom_bytes
    wanted = (
        f"the resident plan {plan.hash} needs {_gib(need)} available"
        f" ({_gib(plan.ram_bytes)} resident + {_gib(policy.headroom_bytes)} headroom)"
    )
    start = clock()
    available = read_available()
    delay = policy.backoff_s
    while available < need:
        left = policy.wait_s - (clock() - start)
        if left <= 0:
            break
        pause = min(delay, left)
        log.info(
            "waiting for RAM: %s, MemAvailable is %s; retrying in %.1fs (for up to %.0fs more)",
            wanted,
            _gib(available),
            pause,
            left,
        )
        sleep(pause)
        delay = min(delay * 2, policy.backoff_max_s)
        available = read_available()
    waited = clock() - start
    if available >= need:
        if waited > 0:
            log.info("RAM available after %.1fs: MemAvailable is %s", waited, _gib(available))
        return Admission(plan, False, available, waited)

    if policy.mode == "refuse":
        message = (
            f"refusing to start: after waiting {waited:.0f}s MemAvailable is {_gib(available)},"
            f" but {wanted}. Free RAM, lower store.resident_budget_gib, or set"
            ' store.on_short_ram = "degrade" to start with fewer resident experts'
        )
        log.error(message)
        raise AdmissionRefused(message)

    granted = max(available - policy.headroom_bytes, 0) // policy.step_bytes * policy.step_bytes
    smaller = replan(min(granted, plan.ram_budget))
    log.warning(
        "running degraded: after waiting %.0fs MemAvailable is %s, but %s; using"
        " plan %s with a resident budget of %s (MemAvailable - headroom, rounded down to"
        " %.2f GiB)%s",
        waited,
        _gib(available),
        wanted,
        smaller.hash,
        _gib(smaller.ram_budget),
        policy.step_bytes / GiB,
        f": {c}" if (c := cost(smaller)) else "",
    )
    return Admission(smaller, True, available, waited)
