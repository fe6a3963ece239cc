"""Suffix decoding: drafts from the sequence itself and from the recent answers of its scope.

Agent loops and chat clients ask again and again for text of one shape: the same tool call
with other arguments, a JSON object of one schema, a retried answer. Prompt lookup
(`drafter.PromptLookup`) sees only the sequence's own prompt and output; suffix decoding (as
vLLM's, after Arctic's SuffixDecoding) also keeps the answers the daemon gave lately, and
drafts what most often followed the sequence's last tokens there.

A sequence's proposal comes from the longer of two matches: its own text's (the latest earlier
occurrence of its longest suffix, as prompt lookup) or the answers' counts (token by token,
the most frequent continuation of the longest context of `min_n` .. `max_n` tokens seen
before, while that continuation holds at least `min_share` of what followed the context, and
no more tokens than that first context is long). The answers are kept per scope (the server's
hash of an API key and user, as cached prefixes are), so one client's answers never steer,
nor time, another's drafts; each scope keeps its last `budget` answer tokens and at most
`scopes` scopes are kept, the least recently used going first.

Drafts only propose: the model verifies every token (`Sequence.verify`), so what they come
from changes the speed, never the output.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from stratad.runtime.speculation.drafter import NgramIndex


class Answers:
    """One scope's recent answer tokens: for each context of `min_n` .. `max_n` tokens, how
    often each token followed it. Its sequences may draft on several threads: one lock."""

    def __init__(self, min_n: int, max_n: int, budget: int) -> None:
        self.min_n, self.max_n, self.budget = min_n, max_n, budget
        self.follow: dict[tuple[int, ...], dict[int, int]] = {}
        self._kept: deque[Answer] = deque()  # oldest first
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, answer: Answer | None, tokens: list[int]) -> Answer:
        """`tokens` counted at the end of `answer` (None, or one dropped since: a new one);
        the answer they are in."""
        with self._lock:
            for token in tokens:
                if answer is None or answer.dropped:
                    answer = Answer()
                    self._kept.append(answer)
                self._add(answer, token)
        assert answer is not None
        return answer

    def _add(self, answer: Answer, token: int) -> None:
        t = answer.tokens
        for n in range(self.min_n, min(self.max_n, len(t)) + 1):
            after = self.follow.setdefault(tuple(t[len(t) - n :]), {})
            after[token] = after.get(token, 0) + 1
        t.append(token)
        self._tokens += 1
        while self._tokens > self.budget and self._kept:
            self._drop(self._kept.popleft())

    def _drop(self, answer: Answer) -> None:
        """Forget an answer's counts (the oldest, past the budget)."""
        t, answer.dropped = answer.tokens, True
        for i in range(len(t)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                context = tuple(t[i - n : i])
                after = self.follow[context]
                after[t[i]] -= 1
                if not after[t[i]]:
                    del after[t[i]]
                    if not after:
                        del self.follow[context]
        self._tokens -= len(t)

    def propose(self, tail: list[int], k: int, min_share: float) -> list[int]:
        """Up to `k` tokens, and no more than the longest known context at the end of `tail`
        is long (a short match is a weak one: vLLM's `max_spec_factor` 1): each the most
        frequent continuation of the longest known context at the end of `tail` + the tokens
        proposed so far, while it holds `min_share`."""
        return self.match(tail, k, min_share)[1]

    def match(self, tail: list[int], k: int, min_share: float) -> tuple[int, list[int]]:
        """`propose`'s tokens after the length of the first context they continue (0:
        none)."""
        with self._lock:
            ctx, first = tail[-self.max_n :], 0
            out: list[int] = []
            while len(out) < k:
                for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
                    after = self.follow.get(tuple(ctx[len(ctx) - n :]))
                    if after:
                        break
                else:
                    break
                token, count = max(after.items(), key=lambda kv: (kv[1], -kv[0]))
                if count < min_share * sum(after.values()):
                    break
                first = first or n
                k = min(k, first)
                out.append(token)
                ctx = [*ctx[1:], token] if len(ctx) >= self.max_n else [*ctx, token]
            return first, out


class Answer:
    """One sequence's answer as its scope's `Answers` keep it (until dropped for newer)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.dropped = False


@dataclass
class SuffixHistory:
    """Every scope's `Answers`, shared by the daemon's sequences (one lock: sequences of
    several threads may draft at once)."""

    min_n: int
    max_n: int
    budget: int
    scopes: int
    _by_scope: OrderedDict[str, Answers] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answers(self, scope: str) -> Answers:
        with self._lock:
            found = self._by_scope.get(scope)
            if found is None:
                found = self._by_scope[scope] = Answers(self.min_n, self.max_n, self.budget)
                while len(self._by_scope) > self.scopes:
                    self._by_scope.popitem(last=False)
            self._by_scope.move_to_end(scope)
            return found


@dataclass(frozen=True)
class SuffixDecoding:
    """The drafter: the longer match of the sequence's own text and its scope's recent
    answers."""

    min_n: int = 2
    max_n: int = 8
    min_share: float = 0.5
    budget: int = 1 << 16  # answer tokens kept per scope
    scopes: int = 64
    history: SuffixHistory = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes {self.min_n}..{self.max_n}: need 1 <= min <= max")
        if not 0.0 < self.min_share <= 1.0:
            raise ValueError(f"min_share {self.min_share} must be in (0, 1]")
        if self.budget < 1 or self.scopes < 1:
            raise ValueError("the answers kept need a budget and scopes of at least 1")
        history = SuffixHistory(self.min_n, self.max_n, self.budget, self.scopes)
        object.__setattr__(self, "history", history)

    def start(self, prompt: list[int], scope: str = "") -> SuffixDrafts:
        own = NgramIndex(self.min_n, self.max_n)
        own.extend(prompt)
        return SuffixDrafts(own, self.history.answers(scope), self.min_share)


class SuffixDrafts:
    """One sequence's drafts: its own n-grams, and its answer counted into its scope's."""

    def __init__(self, own: NgramIndex, answers: Answers, min_share: float) -> None:
        self.own, self.answers, self.min_share = own, answers, min_share
        self.answer: Answer | None = None

    def extend(self, tokens: list[int]) -> None:
        self.own.extend(tokens)
        self.answer = self.answers.add(self.answer, tokens)

    def propose(self, k: int) -> list[int]:
        """The drafts of the longer match: the sequence's own text's, or its scope's answers'
        (a retried answer matches the whole context there, where its own text repeats a
        short phrase)."""
        n, mine = self.own.match(k)
        m, theirs = self.answers.match(self.own.tokens, k, self.min_share)
        return theirs if m > n else mine
