"""How many threads a repeated kernel call runs on, chosen by measuring it.

A call's OpenMP team meets at barriers many times (`kernels/cpu/dense.h`: ten per layer), so
it runs at the pace of its slowest thread: on a host whose cores are busy with other
processes, a preempted thread holds the whole team for a scheduler slice. There, one thread
beats two (SmolLM2 decode on 2 cores beside a test run: 17 ms a step on one thread, 35-50 on
two; llama.cpp alike, 45-53 tok/s on one thread and 16-20 on two), while on idle cores two win.
Which holds changes with the host's load, so the team size is measured: each call shape
(its token count) keeps a moving average of its time per team size, runs at the fastest, and
tries the others once every `PROBE_EVERY` calls. Only calls of up to `PROBE_MAX_TOKENS`
tokens are measured (decode steps, which repeat by the hundred): a longer call runs on every
thread, since its work dwarfs a stalled barrier and a try on one thread would cost a whole
prompt half its speed (each prompt length is a shape of its own, seen once or twice). The
results do not depend on the team size
(every value is computed by one thread in one order), only the time does. A size r times
slower than the best is tried r times less often (up to `MAX_BACKOFF`), so the tries cost
at most some 1/`PROBE_EVERY` of the time however slow the other size has become (two threads
beside a busy neighbour took 138 ms a step where one took 11).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 32  # calls between tries of another size, times how much slower it was
MAX_BACKOFF = 32  # at most PROBE_EVERY * MAX_BACKOFF calls between tries
SMOOTHING = 0.5  # weight of a new time in the moving average (a size tried seldom moves fast)
MAX_SHAPES = 64  # call shapes remembered (token counts; a server sees few)
PROBE_MAX_TOKENS = 8  # longer calls (prompt chunks) always run on the whole team


@dataclass
class _Shape:
    best: int
    calls: int = 0
    next_try: int = PROBE_EVERY  # the call that tries another size
    seconds: dict[int, float] = field(default_factory=dict)  # moving average per team size


class TeamSize:
    """`pick(key)` before a call, `record(key, threads, seconds)` after it."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.sizes = sorted({1, threads})
        self._shapes: dict[int, _Shape] = {}

    def pick(self, key: int) -> int:
        if key > PROBE_MAX_TOKENS:
            return self.threads
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[key] = _Shape(self.threads)
        shape.calls += 1
        if shape.calls == 1:  # the first call pages the weights in: not a measure
            return shape.best
        untried = [n for n in self.sizes if n not in shape.seconds]
        if untried:
            return untried[0]
        others = [n for n in self.sizes if n != shape.best]
        if others and shape.calls >= shape.next_try:
            return others[shape.calls % len(others)]
        return shape.best

    def measured(self, key: int) -> list[int]:
        """The team sizes calls of this shape have been timed on so far."""
        shape = self._shapes.get(key)
        return sorted(shape.seconds) if shape else []

    def record(self, key: int, threads: int, seconds: float) -> None:
        shape = self._shapes.get(key)
        if shape is None or shape.calls == 1:
            return
        old = shape.seconds.get(threads)
        shape.seconds[threads] = seconds if old is None else old + SMOOTHING * (seconds - old)
        shape.best = min(shape.seconds, key=shape.seconds.__getitem__)
        if threads != shape.best:  # a losing try: the next one later the slower it was
            slower = shape.seconds[threads] / max(shape.seconds[shape.best], 1e-9)
            shape.next_try = shape.calls + PROBE_EVERY * min(MAX_BACKOFF, max(1, int(slower)))
