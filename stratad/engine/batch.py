"""A batched forward: B sequences per step, each with its own KV cache and T >= 1 new tokens.

Before a forward, each cache takes the pool blocks its new tokens need (`reserve`).

`run_batch` turns a list of `Seq` into passes of an engine (`Layers`). The sequences that add
a token, and those whose few new tokens (a short prompt, a drafted window to verify) fit the
engine's `row_tokens`, go as one decode pass: a row per new token, each row at its own
position reading its cache up to it, the pass the engine captures as a graph. The others
are prefill: their tokens packed in order into chunks of at most the engine's
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
from stratad.engine.passes import FUSED_MAX_TOKENS, ROW_READS_MAX, Chunk, Pass, Span
from stratad.host_copy import to_device


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

    @property
    def row_tokens(self) -> int:
        """The most new tokens of one sequence a decode pass takes as rows (1: a sequence's
        next token only; prompts and drafted windows go as chunks)."""
        ...

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

    def decode(
        self, tokens: list[int] | torch.Tensor, pos: list[int], caches: Sequence[KVCache]
    ) -> torch.Tensor:
        """Logits [R, V] of rows of one token each: token r at position pos[r] of cache r,
        attending to cache r up to it (a cache may be given for several rows, in order of
        position; the lengths are left as they were). `tokens` on the device: ids the host
        has not read (`run_ahead`)."""
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


def reserve(seqs: Sequence[Seq], chunk: int = 0) -> None:
    """Each cache holds the blocks of its new tokens (raises `KVPoolFull` if the pool has too
    few: the caches reserved before the one that failed keep what they took). `chunk` > 0:
    a cache with a resident window holds those of its first `chunk` only (the prefill takes
    the rest chunk by chunk, as the older blocks leave for the host tier)."""
    for s in seqs:
        n = len(s.tokens)
        if chunk and s.cache.pool.window:
            n = min(n, chunk)
        s.cache.reserve(s.cache.length + n)


def decode_rows(seqs: Sequence[Seq], row_tokens: int) -> list[bool]:
    """Which sequences go in the step's decode pass: every one adding a token, and in the
    rows left beside them those whose new tokens (at most `row_tokens`) keep the pass within
    the fused kernels' rows and each row's attention short (`ROW_READS_MAX`). The final
    norm's output comes from chunks."""

    def wanted(s: Seq) -> bool:
        return s.out is not Output.HIDDEN

    rows = sum(1 for s in seqs if len(s.tokens) == 1 and wanted(s))
    picked = []
    for s in seqs:
        n, end = len(s.tokens), s.cache.length + len(s.tokens)
        fits = n <= row_tokens and rows + n <= FUSED_MAX_TOKENS and n * end <= ROW_READS_MAX
        take = wanted(s) and (n == 1 or fits)
        picked.append(take)
        rows += n if take and n > 1 else 0
    return picked


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
    reserve(seqs, layers.prefill_chunk)
    picked = decode_rows(seqs, layers.row_tokens)
    out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for part, run in ((True, _decode_pass), (False, _prefill)):
        which = [b for b, p in enumerate(picked) if p is part]
        if which:
            for b, o in zip(which, run(layers, [seqs[b] for b in which]), strict=True):
                out[b] = o
    return out


UNREAD = -1  # a cache's token id computed ahead from a device tensor, until the host reads it


def decode_inputs(
    tokens: list[int] | torch.Tensor, pos: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode pass's token ids and positions on `device` (ids given on the device stay
    there, ordered after the work that makes them)."""
    tok = (tokens.to(device) if isinstance(tokens, torch.Tensor)
           else to_device(tokens, torch.long, device))  # fmt: skip
    return tok, to_device(pos, torch.long, device)


def run_ahead(layers: Layers, caches: Sequence[KVCache], tokens: torch.Tensor) -> torch.Tensor:
    """One decode pass of each cache's next token, given on the device (drawn there from the
    pass before, not yet read by the host, so that this pass is queued behind that one
    without waiting for it): logits [R, V]. Each cache grows by one token whose id it holds
    as `UNREAD` until the caller writes it (`KVCache.tokens[-1]`). Raises `KVPoolFull`
    before anything is queued when a cache cannot take its token's block."""
    if tokens.shape != (len(caches),):
        raise ValueError(f"{tuple(tokens.shape)} tokens for {len(caches)} caches")
    seqs = [Seq(c, [UNREAD]) for c in caches]
    check_batch(seqs)
    reserve(seqs)
    logits = layers.decode(tokens, [c.length for c in caches], caches)
    for c in caches:
        _append(c, [UNREAD])
    return logits


def _decode_pass(layers: Layers, seqs: Sequence[Seq]) -> list[torch.Tensor]:
    """One decode pass over every new token of `seqs`, a row each."""
    tokens = [t for s in seqs for t in s.tokens]
    pos = [s.cache.length + j for s in seqs for j in range(len(s.tokens))]
    logits = layers.decode(tokens, pos, [s.cache for s in seqs for _ in s.tokens])
    out, at = [], 0
    for s in seqs:
        n = len(s.tokens)
        out.append(logits[at : at + n] if s.out is Output.LOGITS else logits[at + n - 1 : at + n])
        at += n
        _append(s.cache, s.tokens)
    return out


def _prefill(layers: Layers, seqs: Sequence[Seq]) -> list[torch.Tensor]:
    """The new tokens of `seqs` in chunks of at most `prefill_chunk` tokens."""
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for part in chunks([len(s.tokens) for s in seqs], layers.prefill_chunk):
        spans = tuple(Span(seqs[b].cache.length, n) for b, _, n in part)
        for b, _, n in part:  # (all held already, but where a resident window takes chunks)
            seqs[b].cache.reserve(seqs[b].cache.length + n)
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
