"""What one pass of the offload engine computes: a decode step or a chunk of prompts.

A pass covers a batch: B sequences, each with its own KV cache and its own new tokens, laid
out one after the other in the pass's rows. A pass object replaces the old sentinel
(`start=None` meant decode) and the token-count thresholds spread over the engine: each
helper asks the pass what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

# A pass of at most this many tokens goes through the fused kernels, which read each routed
# expert once where it is (VRAM slot, or a miss path) for every token routed to it (a batch
# of decode steps, a short prompt, a drafted window). Longer passes route to nearly every
# expert of a layer many times over, so the layer's experts are staged whole and run as
# grouped GEMMs.
FUSED_MAX_TOKENS = 64
# A fused pass of at most this many tokens copies the union of its missed experts into VRAM
# staging (the copy miss path, each expert once); a longer one reads its misses in place.
FETCH_MAX_TOKENS = 8
# A sequence's several new tokens (a short prompt, a drafted window) ride in a decode pass as
# rows of their own while rows x the positions each reads stay within this: each row's
# attention reads the sequence's keys up to its position, so a long window deep in a long
# context is cheaper as a chunk (its keys read once).
ROW_READS_MAX = 1 << 18


@dataclass(frozen=True)
class Span:
    """One sequence's share of a chunk: `tokens` new tokens at positions start.."""

    start: int
    tokens: int


@dataclass(frozen=True)
class Decode:
    """`tokens` rows of one new token each, row b of cache b: a sequence's next token, or one
    of its several new tokens (then several rows have the sequence's cache, each at its own
    position, and attends up to it). The positions are read on the device, so one captured
    graph serves every step of the same caches."""

    tokens: int = 1

    decode = True

    @property
    def staged(self) -> bool:
        return self.tokens > FUSED_MAX_TOKENS

    @property
    def fused(self) -> bool:
        return not self.staged

    def rows(self) -> list[slice]:
        """Each row's slice of the pass (one per cache given with it)."""
        return [slice(b, b + 1) for b in range(self.tokens)]


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens of one or more sequences, each attending over its cache up to its end."""

    spans: tuple[Span, ...]

    decode = False

    @classmethod
    def one(cls, start: int, tokens: int) -> Chunk:
        return cls((Span(start, tokens),))

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.spans)

    @property
    def staged(self) -> bool:
        """Every expert of a layer staged into VRAM for grouped GEMMs (a long pass)."""
        return self.tokens > FUSED_MAX_TOKENS

    @property
    def fused(self) -> bool:
        """The routed experts through the fused kernels, as a decode step reads them."""
        return not self.staged

    def rows(self) -> list[slice]:
        out, at = [], 0
        for s in self.spans:
            out.append(slice(at, at + s.tokens))
            at += s.tokens
        return out


Pass = Decode | Chunk
