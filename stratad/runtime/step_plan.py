"""Which running sequences compute what in one step: the scheduler's decision, nothing else.

Every decoding sequence computes its one token, every step: a request that is generating
never waits for another's prompt. Then the sequences still in their prompts take their next
chunk, in the order they arrived, while the step's tokens stay within the budget; the first
that does not fit ends the list (a long chunk is not passed over by later short ones, so no
prompt starves). A step that would compute nothing takes the oldest prompt's chunk whatever
its size. Where the forward takes short prompts as rows of its one decode pass (the offload
engine's graph, `rows` of them), a chunk short enough to ride there (`row_tokens`) waits for
the next step rather than overflow a pass that other prompts fill: the overflow would run as
a separate prefill pass, one attention per sequence per layer launched from Python, which
at 32 arriving prompts cost the first tokens up to a second (r19); taken in the following steps'
passes they cost a few graph replays. A chunk is cut by the sequence itself
(`Sequence.next_tokens`), at multiples of the prefill chunk from where its prompt started
and at its pin, whatever else runs: the tokens a request computes per forward never depend
on its neighbours.

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
    rows: int = 0  # the rows of the forward's one decode pass (0: it has none)
    row_tokens: int = 0  # a prompt chunk of at most this many tokens rides there as rows

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.chunk < 1 or self.rows < 0 or self.row_tokens < 0:
            raise ValueError(f"a step budget must be positive: {self}")

    @classmethod
    def auto(
        cls, chunk: int, parallel: int, tokens: int = 0, rows: int = 0, row_tokens: int = 0
    ) -> StepBudget:
        """`tokens` 0: one full prompt chunk beside a decode token of every running request."""
        return cls(tokens=tokens or chunk + parallel, chunk=chunk, rows=rows,
                   row_tokens=row_tokens)  # fmt: skip

    def as_rows(self, tokens: int) -> bool:
        """Whether a prompt chunk of `tokens` rides in the decode pass as rows."""
        return 1 < tokens <= self.row_tokens and self.rows > 0


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
    rows, riding = used, False  # each decode token is a row of the pass
    for i, w in enumerate(wants):
        if w.decoding:
            continue
        if used + w.tokens > budget.tokens and used:
            break
        if budget.as_rows(w.tokens):
            # the pass is full of this step's prompts: the next step's takes it (a prompt
            # that the decodes alone leave no room for runs now, as a chunk: none starves)
            if rows + w.tokens > budget.rows and riding:
                break
            rows, riding = rows + w.tokens, True
        chosen.append(i)
        used += w.tokens
    return sorted(chosen)
