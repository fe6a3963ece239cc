"""llama-server's `timings` object: how long a request's prompt and its generation took.

`/completion` answers always carry it; OpenAI answers when the request sets
`timings_per_token` (llama-server's field). The prompt phase runs from the request's start on
the engine to its first token, the generation phase from there to the last token; `cache_n`
prompt tokens came from the prefix cache and were not computed.
"""

from __future__ import annotations

import msgspec

from stratad.runtime.jobs import Delta
from stratad.runtime.scheduler import Ticket


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """A request's speed, as llama-server reports it."""

    cache_n: int
    """prompt tokens reused from the cache"""
    prompt_n: int
    """prompt tokens computed"""
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    """tokens generated"""
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


def _rates(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second); 0 where nothing was timed."""
    return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)


def timings_of(pairs: list[tuple[Ticket, Delta]]) -> Timings:
    """The timings of tickets (a request's choices, summed) as of each one's latest delta."""
    cache_n = prompt_n = predicted_n = 0
    prompt_ms = predicted_ms = 0.0
    for ticket, delta in pairs:
        cache_n += delta.cached_tokens
        prompt_n += delta.prompt_tokens - delta.cached_tokens
        predicted_n += delta.completion_tokens
        if ticket.started is not None and ticket.first_token is not None:
            prompt_ms += 1e3 * (ticket.first_token - ticket.started)
            predicted_ms += 1e3 * max((ticket.last_at or ticket.first_token) - ticket.first_token,
                                      0.0)  # fmt: skip
    prompt_per_token, prompt_per_second = _rates(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = _rates(predicted_n, predicted_ms)
    return Timings(
        cache_n=cache_n,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_per_token,
        prompt_per_second=prompt_per_second,
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_per_token,
        predicted_per_second=predicted_per_second,
    )
