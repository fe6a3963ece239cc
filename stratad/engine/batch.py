"""A batched forward: B sequences per step, each with its own KV cache and T >= 1 new tokens.

Before a forward, each cache takes the pool blocks its new tokens need (`reserve`).

`run_batch` turns a list of `Seq` into passes of an engine (`Layers`): a batch whose every
sequence adds one token to a started cache is one decode pass (B rows, one token each);
anything else is prefill, its tokens packed in order into chunks of at most the engine's
`prefill_chunk` tokens, a chunk holding the end of one sequence's tokens and the start of
the next one's. Each sequence gets what its `Output` asks: the logits of its last new token,
of every new token (a verify window), or the final norm's output of every new token (the
hidden states an embedding pools).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from stratad.engine.kv import KVCache
from stratad.engine.passes import Chunk, Pass, Span


class Output(Enum):
    """What a sequence of a batch gets back from the step."""

    NEXT = "next"  # logits [1, V] of its last new token: the next token is drawn from them
    LOGITS = "logits"  # logits [T, V] of every new token (a drafted window to verify)
    HIDDEN = "hidden"  # the final norm's output [T, H] float32 of every new token (pooling)


@dataclass(frozen=True)
class Seq:
    """One sequence of a batch: `tokens` to append to `cache`."""

    cache: KVCache
    tokens: list[int]
    out: Output = Output.NEXT

    @classmethod
    def logits(cls, cache: KVCache, tokens: list[int], every: bool) -> Seq:
        """The sequence asking for the logits of its last new token, or of `every` one."""
        return cls(cache, tokens, Output.LOGITS if every else Output.NEXT)


class Layers(Protocol):
    """What `run_batch` drives: an engine on one device or a pipeline of them."""

    @property
    def prefill_chunk(self) -> int: ...

    def run(
        self, tokens: list[int], pos: list[int], caches: Sequence[KVCache], step: Pass
    ) -> torch.Tensor:
        """The hidden states [T, H] of the pass's rows after every layer (the caches are
        written, their lengths left as they were)."""
        ...

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] float32 of the hidden rows x [R, H]."""
        ...

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm's output [R, H] float32 of the hidden rows x [R, H] (what `head`
        multiplies by the output matrix)."""
        ...

    def decode(self, tokens: list[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """Logits [B, V] after token b appended to cache b (lengths left as they were)."""
        ...


def check_batch(seqs: Sequence[Seq]) -> None:
    if not seqs:
        raise ValueError("an empty batch")
    if len({id(s.cache) for s in seqs}) != len(seqs):
        raise ValueError("two sequences of one batch share a KV cache")
    for s in seqs:
        if not s.tokens:
            raise ValueError("a sequence of the batch has no new tokens")
        if s.cache.length + len(s.tokens) > s.cache.capacity:
            raise ValueError(
                f"{s.cache.length + len(s.tokens)} tokens exceed the KV cache of"
                f" {s.cache.capacity}"
            )


def reserve(seqs: Sequence[Seq]) -> None:
    """Each cache holds the blocks of its new tokens (raises `KVPoolFull` if the pool has too
    few: the caches reserved before the one that failed keep what they took)."""
    for s in seqs:
        s.cache.reserve(s.cache.length + len(s.tokens))


def is_decode(seqs: Sequence[Seq]) -> bool:
    """Every sequence adds one token to a started cache and asks for its logits."""
    return all(
        len(s.tokens) == 1 and s.cache.length > 0 and s.out is not Output.HIDDEN for s in seqs
    )


def chunks(lengths: Sequence[int], budget: int) -> Iterator[list[tuple[int, int, int]]]:
    """The passes of a prefill, as (sequence, first new token, count) per pass: the tokens
    in order, at most `budget` per pass, each sequence at most once per pass."""
    part: list[tuple[int, int, int]] = []
    room = budget
    for b, n in enumerate(lengths):
        at = 0
        while at < n:
            take = min(room, n - at)
            part.append((b, at, take))
            at, room = at + take, room - take
            if room == 0:
                yield part
                part, room = [], budget
    if part:
        yield part


def _append(cache: KVCache, tokens: list[int]) -> None:
    cache.length += len(tokens)
    cache.tokens.extend(tokens)


def run_batch(layers: Layers, seqs: Sequence[Seq]) -> list[torch.Tensor]:
    """Each sequence's `Output`: logits [1, V] of its last new token, [T, V] of every one, or
    the final norm's output [T, H]."""
    check_batch(seqs)
    reserve(seqs)
    if is_decode(seqs):
        logits = layers.decode([s.tokens[0] for s in seqs], [s.cache for s in seqs])
        for s in seqs:
            _append(s.cache, s.tokens)
        return [logits[b : b + 1] for b in range(len(seqs))]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for part in chunks([len(s.tokens) for s in seqs], layers.prefill_chunk):
        spans = tuple(Span(seqs[b].cache.length, n) for b, _, n in part)
        tokens = [t for b, at, n in part for t in seqs[b].tokens[at : at + n]]
        pos = [p for s in spans for p in range(s.start, s.start + s.tokens)]
        x = layers.run(tokens, pos, [seqs[b].cache for b, _, _ in part], Chunk(spans))
        heads: list[tuple[int, int]] = []  # (sequence, row) of the logits asked for
        norms: list[tuple[int, int]] = []  # (sequence, row) of the final norm's outputs
        row = 0
        for b, at, n in part:
            want = seqs[b].out
            if want is Output.HIDDEN:
                norms.extend((b, r) for r in range(row, row + n))
            elif want is Output.LOGITS:
                heads.extend((b, r) for r in range(row, row + n))
            elif at + n == len(seqs[b].tokens):
                heads.append((b, row + n - 1))
            row += n
        for wanted, rows_of in ((heads, layers.head), (norms, layers.final_norm)):
            if wanted:
                rows = rows_of(x[torch.tensor([r for _, r in wanted], device=x.device)])
                for (b, _), r in zip(wanted, rows.split(1), strict=True):
                    out[b].append(r)
        for b, at, n in part:
            _append(seqs[b].cache, seqs[b].tokens[at : at + n])
    return [torch.cat(o) for o in out]
