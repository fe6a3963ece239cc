"""The A/B/A driver: is a kernel path's switch worth turning, on this machine? (pure Python)

Two arms (A, the current default; B, the other setting) run alternately, A first and last
(A B A B ... A), so a drift of the machine (clocks, heat, the page cache) lands on both arms
instead of on one. Each arm reports its median and spread (± half its range, as a share of its
median). A difference is called real only when it exceeds the spread: the gap between the
medians is larger than both arms' spreads added (their ranges do not overlap), and larger than
the noise floor known for that kind of measurement, since a few samples can look tighter than
the machine is. Seed 001 measured the floors: ±1% run to run on long cold reads (33K-200K
tokens), ±7% on 8K prompts and on decode, where a first-sample "+8.6%" became a dead heat on
A/B/A.

`record` turns a verdict into a table's `switches` entry (`kernels.tuning.table_file`): the value to
run by default on this architecture, and the run that justifies it. B replaces A only on a
real difference in B's favour.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# the run-to-run noise of each kind of measurement (a share of the median)
NOISE_FLOOR: Mapping[str, float] = {
    "cold-read": 0.01,  # prefill of a long prompt from cold (seed 001: ±1%)
    "prompt-8k": 0.07,  # an 8K prompt (seed 001: ±7%)
    "decode": 0.07,  # decode tokens per second (seed 001: ±7%)
    "kernel": 0.03,  # one kernel in a CUDA graph (the tuner's margin, stratad.tuning.tuner)
}


@dataclass(frozen=True)
class Arm:
    name: str
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """± half the range, as a share of the median."""
        return (max(self.samples) - min(self.samples)) / 2 / abs(self.median)

    def as_json(self) -> dict[str, Any]:
        return {"median": self.median, "spread": round(self.spread, 4),
                "samples": list(self.samples)}  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    a: Arm
    b: Arm
    kind: str
    higher_is_better: bool  # tokens per second: True; seconds: False

    @property
    def difference(self) -> float:
        """B against A, a share of A's median (positive: B measured higher)."""
        return (self.b.median - self.a.median) / abs(self.a.median)

    @property
    def noise(self) -> float:
        """The difference must exceed this to be real."""
        return max(self.a.spread + self.b.spread, NOISE_FLOOR[self.kind])

    @property
    def real(self) -> bool:
        return abs(self.difference) > self.noise

    @property
    def better(self) -> str | None:
        """The arm that is really better, or None (a dead heat within the noise)."""
        if not self.real:
            return None
        b_up = self.difference > 0
        return self.b.name if b_up == self.higher_is_better else self.a.name

    def summary(self) -> str:
        arms = ", ".join(f"{arm.name} {arm.median:.4g} ±{arm.spread:.1%} (n={len(arm.samples)})"
                         for arm in (self.a, self.b))  # fmt: skip
        verdict = (f"{self.better} is better" if self.real else "no real difference")
        return (f"{arms}: {self.b.name} vs {self.a.name} {self.difference:+.1%}, noise"
                f" ±{self.noise:.1%} ({self.kind}): {verdict}")

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "higher_is_better": self.higher_is_better,
                "arms": {self.a.name: self.a.as_json(), self.b.name: self.b.as_json()},
                "difference": round(self.difference, 4), "noise": round(self.noise, 4),
                "real": self.real, "better": self.better}  # fmt: skip


def run_ab(
    a: tuple[str, Callable[[], float]],
    b: tuple[str, Callable[[], float]],
    rounds: int = 3,
    kind: str = "decode",
    higher_is_better: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Verdict:
    """Run A B A B ... A: `rounds` samples of B and `rounds` + 1 of A; each callable returns one
    measurement (a rate or a time)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    if kind not in NOISE_FLOOR:
        raise ValueError(f"kind {kind!r}: one of {', '.join(NOISE_FLOOR)}")
    samples: dict[str, list[float]] = {a[0]: [], b[0]: []}
    for name, measure in [a, b] * rounds + [a]:
        value = float(measure())
        samples[name].append(value)
        if progress is not None:
            progress(f"{name} {len(samples[name])}: {value:.4g}")
    return Verdict(Arm(a[0], tuple(samples[a[0]])), Arm(b[0], tuple(samples[b[0]])), kind,
                   higher_is_better)  # fmt: skip


def record(verdict: Verdict, values: Mapping[str, Any]) -> dict[str, Any]:
    """A table's `switches` entry: B's value only when B is really better, else A's (the
    default stays unless the run shows otherwise)."""
    chosen = verdict.b.name if verdict.better == verdict.b.name else verdict.a.name
    return {"value": values[chosen], "ab": verdict.as_json()}
