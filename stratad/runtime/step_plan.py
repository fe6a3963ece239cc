"""Which running sequences compute what in one step: the scheduler's decision, nothing else.

Every decoding sequence computes its one token, every step: a request that is generating
never waits for another's prompt. Then the sequences still in their prompts take their next
chunk, in the order they arrived, while the step's tokens stay within the budget; the first
that does not fit ends the list (a long chunk is not passed over by later short ones, so no
prompt starves). A step that would compute nothing takes the oldest prompt's chunk whatever
its size. A chunk is cut by the sequence itself (`Sequence.next_tokens`), at multiples of the
prefill chunk from where its prompt started and at its pin, whatever else runs: the tokens a
request computes per forward never depend on its neighbours.

Pure and torch-free: the unit tests drive it with plain numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBudget:
    """How much one step computes at most."""

    tokens: int  # the step's tokens: decodes and prompt chunks together
    chunk: int  # one prompt's tokens per step at most

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.chunk < 1:
            raise ValueError(f"a step budget must be positive: {self}")

    @classmethod
    def auto(cls, chunk: int, parallel: int, tokens: int = 0) -> StepBudget:
        """`tokens` 0: one full prompt chunk beside a decode token of every running request."""
        return cls(tokens=tokens or chunk + parallel, chunk=chunk)


@dataclass(frozen=True)
class Want:
    """What one running sequence would compute this step."""

    tokens: int  # its next tokens: 1 to decode, a chunk's length in its prompt
    decoding: bool
    blocks: int = 0  # KV blocks those tokens need beyond what it holds
    held: int = 0  # KV blocks it holds (what preempting it gives back)


def plan_step(wants: Sequence[Want], budget: StepBudget) -> list[int]:
    """The indices of `wants` (in arrival order) that compute this step, in that order."""
    chosen = [i for i, w in enumerate(wants) if w.decoding]
    used = sum(wants[i].tokens for i in chosen)  # a verify computes its drafts too
    for i, w in enumerate(wants):
        if w.decoding:
            continue
        if used + w.tokens > budget.tokens and used:
            break
        chosen.append(i)
        used += w.tokens
    return sorted(chosen)
