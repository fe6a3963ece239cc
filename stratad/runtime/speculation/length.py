"""How many tokens to draft for one sequence next: from how many of its drafts were accepted.

With a share a of drafted tokens accepted where they were checked (taken as independent per
position), the j-th token of a draft is accepted with probability a^j, and it costs a share c
of a decode step to verify (measured on the engine's own steps: `speculation.cost`). So a
draft grows while a^j > c, up to `max_k`; below a^1 < c drafting stops for `rest` steps, then
tries one token again.

A verify checks a draft's tokens in turn up to the first that does not stand: the tokens
after it were never checked. So the share is accepted over checked tokens (a run of 3 that
stood and a miss: 3 of 4), not over drafted ones (3 of 8), which read a copy whose drafts
stand 90% of the time as 64% and cut its drafts to two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    max_k: int
    rest: int = 16  # steps without drafting once drafts stopped paying
    alpha: float = 0.3  # weight of the newest verify in the moving sums
    prior: float = 0.6  # the acceptance share before any verify (optimistic), as one token
    _resting: int = 0

    def __post_init__(self) -> None:
        self._hits, self._checked = self.prior, 1.0

    @property
    def rate(self) -> float:
        """The share of checked drafted tokens that stood (moving sums of both)."""
        return self._hits / self._checked if self._checked > 0 else 0.0

    def next(self, token_cost: float) -> int:
        """Tokens to draft this step (0: decode without a draft), a drafted token costing
        `token_cost` of a decode step."""
        if self._resting:
            self._resting -= 1
            return 0 if self._resting else 1  # the last rested step probes with one token
        k, gain = 0, self.rate
        while k < self.max_k and gain > token_cost:
            k, gain = k + 1, gain * self.rate
        if k == 0:
            self._resting = self.rest
        return k

    def record(self, checked: int, accepted: int) -> None:
        """A verify's outcome: `checked` drafted tokens were compared with the sampled ones
        (> 0: up to and including the first that did not stand), `accepted` of them stood."""
        self._hits += self.alpha * (accepted - self._hits)
        self._checked += self.alpha * (checked - self._checked)
