"""A drafter for tests that must see drafts both stand and be rejected: it proposes the
answer the test already knows, every other proposal's second token wrong."""

from __future__ import annotations


class KnownAnswer:
    """The drafter (`speculation.drafter.Drafter`): each sequence's drafts of `answer`."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer

    def start(self, prompt: list[int], scope: str = "") -> KnownDrafts:
        return KnownDrafts(self.answer)


class KnownDrafts:
    def __init__(self, answer: list[int]) -> None:
        self.answer, self.done, self.calls = answer, 0, 0

    def extend(self, tokens: list[int]) -> None:
        self.done += len(tokens)  # the sequence's sampled tokens so far

    def propose(self, k: int) -> list[int]:
        self.calls += 1
        out = list(self.answer[self.done : self.done + k])
        if self.calls % 2 and len(out) > 1:
            out[1] += 1
        return out
