"""An embedding request as state a step advances: its prompt computed chunk by chunk, the
final norm's output of every token pooled into one vector, and nothing sampled.

A `Pooling` runs in the step loop beside generating `Sequence`s, on a working cache of its
own. Each of its chunks asks the forward for the hidden states of its tokens (`Output.HIDDEN`)
instead of logits; `pool` folds them in as they come (`mean`: their sum; `last`: the last
row), and once the prompt is in, its one event is the pooled vector, L2-normalised. It takes
no memory beyond what a completion of the same prompt takes: the working cache's KV and one
vector of the model's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from stratad.engine.batch import Output
from stratad.engine.kv import KVCache
from stratad.runtime.jobs import PoolingKind

POOLINGS: tuple[PoolingKind, ...] = get_args(PoolingKind)


@dataclass(frozen=True)
class PoolingRequest:
    prompt: list[int]
    pooling: PoolingKind = "mean"
    scope: str = ""  # whose conversation its working cache holds afterwards


@dataclass(frozen=True)
class PooledEvent:
    """The pooled, L2-normalised hidden state [H] float32 of a request's prompt: its only
    event, the last."""

    vector: torch.Tensor
    finish_reason: str = "stop"


class Pooling:
    out = Output.HIDDEN  # what it asks of each forward

    def __init__(self, req: PoolingRequest, cache: KVCache, max_context: int) -> None:
        """`cache` starts empty: every token's hidden state is pooled, so none is reused."""
        if not req.prompt:
            raise ValueError("empty prompt")
        if len(req.prompt) > max_context:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens does not fit the context of {max_context}"
            )
        if req.pooling not in POOLINGS:
            raise ValueError(f"pooling {req.pooling!r} is none of {', '.join(POOLINGS)}")
        if cache.length:
            raise ValueError("a pooled prompt is computed from an empty cache")
        self.req, self.cache = req, cache
        self.pos = 0  # prompt tokens computed
        self.pooled: torch.Tensor | None = None  # [H] float32: the sum, or the last row
        self.cached_tokens = 0  # prompt tokens reused from a known prefix: none

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.req.prompt)

    def next_tokens(self, chunk: int) -> list[int]:
        """The next chunk of the prompt, cut at multiples of `chunk` as a `Sequence` cuts."""
        return self.req.prompt[self.pos : self.pos + chunk]

    def preempt(self) -> None:
        """Give the KV blocks back: the prompt is computed again from its start."""
        self.cache.release()
        self.pos, self.pooled = 0, None

    def pool(self, hidden: torch.Tensor) -> PooledEvent | None:
        """Fold in the hidden states [n, H] of the tokens `next_tokens` gave; the event once
        the prompt is in, else None."""
        self.pos += hidden.shape[0]
        rows = hidden.float()
        if self.req.pooling == "last":
            self.pooled = rows[-1].clone()
        else:
            part = rows.sum(0)
            self.pooled = part if self.pooled is None else self.pooled + part
        if self.prefilling:
            return None
        assert self.pooled is not None
        vector = self.pooled / len(self.req.prompt) if self.req.pooling == "mean" else self.pooled
        return PooledEvent(torch.nn.functional.normalize(vector, dim=0))
