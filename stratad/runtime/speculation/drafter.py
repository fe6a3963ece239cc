"""Drafters: where a sequence's proposed next tokens come from.

`PromptLookup` is prompt-lookup decoding (llama.cpp's `lookup`, vLLM's n-gram speculator):
the last n tokens of the sequence (prompt and output so far) are looked for earlier in it,
longest n first, and the tokens that followed the latest earlier occurrence are proposed.
It costs no model and pays where the answer repeats its input: code edits, quotes, filling a
schema from a record, agent loops. Each sequence keeps its own index of n-grams, extended as
its tokens come, so a proposal is a few dictionary lookups whatever the length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class Drafts(Protocol):
    """One sequence's drafter: fed the sequence's tokens as they are settled."""

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens likely to follow those so far (none: nothing to propose)."""
        ...


def propose_all(asks: Sequence[tuple[Drafts, int]]) -> list[list[int]]:
    """Each (sequence's drafts, k)'s proposal of up to k tokens. Drafts of a kind that can
    propose for many sequences at once (a static method `propose_many`: a draft model's passes
    as one batch) do so together; the others one by one."""
    out: list[list[int]] = [[] for _ in asks]
    together: dict[Callable[..., list[list[int]]], list[int]] = {}
    for i, (drafts, k) in enumerate(asks):
        many = getattr(type(drafts), "propose_many", None)
        if many is None:
            out[i] = drafts.propose(k)
        else:
            together.setdefault(many, []).append(i)
    for many, at in together.items():
        for i, proposed in zip(at, many([asks[i] for i in at]), strict=True):
            out[i] = proposed
    return out


class Drafter(Protocol):
    """A kind of drafter (a setting): makes each sequence's own; `scope` is the request's
    (`Job.scope`): a drafter that learns across requests keeps scopes apart."""

    def start(self, prompt: list[int], scope: str = "") -> Drafts: ...


@dataclass(frozen=True)
class PromptLookup:
    """Match the last `max_n` .. `min_n` tokens earlier in the sequence."""

    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes {self.min_n}..{self.max_n}: need 1 <= min <= max")

    def start(self, prompt: list[int], scope: str = "") -> NgramIndex:
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(prompt)
        return index


class NgramIndex:
    """A sequence's tokens and, for each n-gram of the sizes looked for, where its latest
    occurrence before the sequence's tail ends."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions 1 .. _indexed are in _ends

    def extend(self, tokens: list[int]) -> None:
        t = self.tokens
        t.extend(tokens)
        # index every n-gram that ends before the tail (the tail's own would find itself)
        for end in range(self._indexed + 1, len(t)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(t[end - n : end])] = end
        self._indexed = max(self._indexed, len(t) - 1)

    def propose(self, k: int) -> list[int]:
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """The length of the longest suffix found earlier (0: none) and up to `k` tokens that
        followed its latest occurrence."""
        t = self.tokens
        for n in range(min(self.max_n, len(t)), self.min_n - 1, -1):
            end = self._ends.get(tuple(t[len(t) - n :]))
            if end is not None:
                return n, t[end : end + k]
        return 0, []
