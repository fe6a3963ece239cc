"""How many tokens to draft for one sequence next: from how many of its drafts were accepted.

With a share a of drafted tokens accepted (taken as independent per position), the j-th
token of a draft is accepted with probability a^j, and it costs a share c of a decode step to
verify (measured on the engine's own steps: `speculation.cost`). So a draft grows while
a^j > c, up to `max_k`; below a^1 < c drafting stops for `rest` steps, then tries one token
again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    max_k: int
    rest: int = 16  # steps without drafting once drafts stopped paying
    alpha: float = 0.3  # weight of the newest verify in the acceptance average
    rate: float = 0.6  # the acceptance share so far (a moving average; optimistic start)
    _resting: int = 0

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

    def record(self, drafted: int, accepted: int) -> None:
        """A verify's outcome (`drafted` > 0)."""
        self.rate += self.alpha * (accepted / drafted - self.rate)
