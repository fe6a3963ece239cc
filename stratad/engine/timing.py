"""Stage timing of engine steps (STRATA_DECODE_TIMING / engine.decode_timing).

On a GPU, stages are bracketed with CUDA events and read after the step, so timing adds no
synchronisation inside the step; on the CPU, wall-clock time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StageTimer:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.totals[name] += (time.perf_counter() - t0) * 1e3

    def collect(self) -> dict[str, float]:
        """Milliseconds per stage so far (synchronises on the recorded events)."""
        for name, start, end in self._events:
            end.synchronize()
            self.totals[name] += start.elapsed_time(end)
        self._events.clear()
        return dict(self.totals)

    def reset(self) -> None:
        self.totals.clear()
        self._events.clear()


def stages_text(ms: dict[str, float], unit: str = "ms") -> str:
    """Stages by time, largest first: '12.40 ms = experts 8.10, attention 3.20 (ms)'."""
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ms.items(), key=lambda kv: -kv[1]))
    return f"{sum(ms.values()):.2f} {unit} = {parts} (ms)"


def tier_shares(stats: object) -> str:
    hits = {k: getattr(stats, f"{k}_hits", 0) for k in ("vram", "ram", "file")}
    total = sum(hits.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in hits.items())
