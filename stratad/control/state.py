"""The daemon's side of the control socket: what it knows about itself, as protocol replies.

`DaemonState` is filled in as the daemon goes: the engine's description once the model is
loaded, the expert store's view once it exists (`StoreView`, see `stratad.control.store_view`),
pinning progress from the store's callback, request counts from the HTTP gate
(`stratad.control.gate`), and the HTTP side itself (`Serving`): its health body, and the drain,
which the scheduler owns. No torch here: whatever needs the GPU runtime arrives as a callable.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import psutil

from stratad import __version__
from stratad.control.provider import Unavailable
from stratad.protocol import (
    CoverageReply,
    DrainReply,
    Health,
    MemoryUse,
    PlanReply,
    ProfileSaveReply,
    Progress,
    Requests,
    StageTiming,
    State,
    StatsReply,
    StatusReply,
    UndrainReply,
)

DRAINED_BY_CONTROL = "stratactl drain"


@dataclass(frozen=True)
class EngineView:
    """What the control socket shows of the loaded engine."""

    model: str
    arch: str
    device: str
    moe: bool
    vram: Callable[[], tuple[int, int]] | None = None
    """(used, total) bytes of the engine's GPU, or None on the CPU."""


class StoreView(Protocol):
    """The expert store as the control socket reads it (adapter: stratad.control.store_view)."""

    def plan(self) -> PlanReply: ...

    def coverage(self) -> CoverageReply: ...

    def tier_hits(self) -> dict[str, int]: ...

    def pinned_bytes(self) -> int: ...

    def save_profile(self, path: str) -> ProfileSaveReply: ...


class Serving(Protocol):
    """The HTTP side as the control socket drives it (`stratad.server.app.Server`)."""

    def health(self) -> Health: ...

    def begin_drain(self, reason: str) -> None: ...

    def undrain(self) -> bool: ...

    def wait_idle(self, timeout_s: float) -> int:
        """Block until no request is queued or running (or the timeout); how many still are."""
        ...


class Meter:
    """Request and token counts and per-stage wall times; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.active = 0
        self.refused = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._stages: dict[str, tuple[int, float]] = {}

    def started(self) -> None:
        with self._lock:
            self.active += 1

    def finished(self, refused: bool = False) -> None:
        with self._lock:
            self.active -= 1
            self.total += 1
            self.refused += refused

    def tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def stage(self, name: str, seconds: float) -> None:
        with self._lock:
            calls, total = self._stages.get(name, (0, 0.0))
            self._stages[name] = (calls + 1, total + seconds)

    def stages(self) -> list[StageTiming]:
        with self._lock:
            return [
                StageTiming(name=n, calls=c, total_ms=t * 1e3) for n, (c, t) in self._stages.items()
            ]


class DaemonState:
    """Implements `stratad.control.provider.Provider` for the running daemon."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.state: State = "starting"
        self.meter = Meter()
        self.engine: EngineView | None = None
        self.store: StoreView | None = None
        self.pinning: Progress | None = None
        self.serving: Serving | None = None
        """The HTTP side, once it is set up: health, queue, drain."""
        self.engine_stages: Callable[[], list[StageTiming]] | None = None
        self.engine_counters: Callable[[], dict[str, int]] | None = None
        """The engine's own stage timings (STRATA_DECODE_TIMING), when it records them."""

    # ---- what the daemon tells it --------------------------------------------------------

    def set_state(self, state: State) -> None:
        self.state = state

    # ---- Provider ------------------------------------------------------------------------

    def status(self) -> StatusReply:
        e = self.engine
        proc = psutil.Process()
        vm = psutil.virtual_memory()
        vram: tuple[int, int] | tuple[None, None] = (None, None)
        if e is not None and e.vram is not None:
            vram = e.vram()
        active = self.meter.active
        health = self.serving.health() if self.serving is not None else None
        queued = health.waiting if health is not None else max(0, active - 1)
        state = self.state
        if state == "serving" and health is not None and health.status == "draining":
            state = "draining"
        plan_hash, complete = "", None
        if self.store is not None:
            plan_hash = self.store.plan().hash
            complete = self.store.coverage().complete
        elif e is not None and not e.moe:
            plan_hash, complete = "dense", True
        return StatusReply(
            state=state,
            version=__version__,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
            model=e.model if e else "",
            arch=e.arch if e else "",
            device=e.device if e else "",
            moe=e.moe if e else False,
            plan_hash=plan_hash,
            coverage_complete=complete,
            requests=Requests(
                total=self.meter.total, active=active, queued=queued, refused=self.meter.refused
            ),
            pinning=self.pinning,
            memory=MemoryUse(
                rss_bytes=proc.memory_info().rss,
                pinned_bytes=self.store.pinned_bytes() if self.store else 0,
                host_total_bytes=vm.total,
                host_available_bytes=vm.available,
                vram_used_bytes=vram[0],
                vram_total_bytes=vram[1],
            ),
            health=health,
        )

    def _loaded(self) -> EngineView:
        if self.engine is None:
            raise Unavailable(f"the model is not loaded yet (state: {self.state})")
        return self.engine

    def coverage(self) -> CoverageReply:
        e = self._loaded()
        if self.store is not None:
            return self.store.coverage()
        if not e.moe:
            return CoverageReply(moe=False)
        raise Unavailable("this engine runs without the expert store: no coverage to report")

    def plan(self) -> PlanReply:
        e = self._loaded()
        if self.store is not None:
            return self.store.plan()
        if not e.moe:
            return PlanReply(hash="dense", moe=False)
        raise Unavailable("this engine runs without the expert store: no residency plan")

    def stats(self) -> StatsReply:
        stages = self.meter.stages()
        if self.engine_stages is not None:
            stages += self.engine_stages()
        return StatsReply(
            requests=self.meter.total,
            prompt_tokens=self.meter.prompt_tokens,
            completion_tokens=self.meter.completion_tokens,
            stages=stages,
            tier_hits=self.store.tier_hits() if self.store else {},
            counters=self.engine_counters() if self.engine_counters is not None else {},
        )

    def save_profile(self, path: str) -> ProfileSaveReply:
        e = self._loaded()
        if self.store is not None:
            return self.store.save_profile(path)
        if not e.moe:
            raise Unavailable("the model has no routed experts: there is no expert profile")
        raise Unavailable("this engine runs without the expert store: no expert profile")

    def _serving(self) -> Serving:
        if self.serving is None:
            raise Unavailable(f"the HTTP side is not up yet (state: {self.state})")
        return self.serving

    def drain(self, wait_s: float) -> DrainReply:
        serving = self._serving()
        serving.begin_drain(DRAINED_BY_CONTROL)
        left = serving.wait_idle(wait_s)
        return DrainReply(in_flight=left, drained=left == 0)

    def undrain(self) -> UndrainReply:
        serving = self._serving()
        taken = serving.undrain()
        return UndrainReply(serving=taken, state=serving.health().status)
