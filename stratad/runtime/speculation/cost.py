"""What verifying one drafted token costs, as a share of a decode step, measured on the
engine's own steps.

A drafted token is one more row of its step. What that row costs depends on the engine, the
draft's length and where the experts live: on the 2-core VM's cpu engine (the default model,
256 tokens in, timed beside a running test suite) 0.38 of a step for one draft and 0.82 each
for eight; on the H100 all resident 0.47 and 0.69, at 4 GiB of expert VRAM 0.56 and 1.3 (the
rows route to experts that miss; `bench.gpu.verify_cost`). A fixed `speculation.token_cost` is
right for one of them at best, so the loop times its steps: a step of n sequences without
drafts or prompt tokens sets the baseline of n, and a step of n sequences with d drafted
tokens in all gives (seconds / baseline(n) - 1) / d. A step is timed from before its drafts
are proposed, so a draft model's own passes count in what its drafted tokens cost. Both are
moving averages; until both are measured the configured share stands (the prior).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TOKEN_COST = 0.2  # the prior where the config gives none


@dataclass
class StepCost:
    prior: float  # the share until measured (`speculation.token_cost`)
    alpha: float = 0.2  # weight of the newest step in each moving average
    _base: dict[int, float] = field(default_factory=dict)  # sequences -> seconds a step
    _share: float | None = None
    verifies: int = 0  # verifying steps measured

    def observe(self, seqs: int, drafted: int, seconds: float) -> None:
        """A step of `seqs` sequences, each computing its next token and `drafted` drafted
        tokens in all (no prompt tokens), that took `seconds` (forward and sampling)."""
        if drafted == 0:
            base = self._base.get(seqs)
            self._base[seqs] = seconds if base is None else base + self.alpha * (seconds - base)
            return
        base = self._base.get(seqs)
        if base is None or base <= 0:
            return
        share = min(max((seconds / base - 1.0) / drafted, 0.0), 2.0)  # one odd step bounded
        self._share = share if self._share is None else self._share + self.alpha * (
            share - self._share
        )
        self.verifies += 1

    @property
    def token_cost(self) -> float:
        """The share of a decode step one drafted token costs: measured, else the prior."""
        return self.prior if self._share is None else self._share

    @property
    def measured(self) -> bool:
        return self._share is not None
