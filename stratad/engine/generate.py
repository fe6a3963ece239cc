"""The generation loop of one request: prefill, then decode until a stop condition.

Prefill reuses the longest known prefix of the prompt (the working cache's, or a snapshot in
the `PrefixStore`) and computes the rest in chunks; `cancelled()` is polled before every chunk
and every decoded token, so a cancelled request frees the engine within one of either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stratad.engine.kv import KVCache
from stratad.engine.prefix import PrefixStore
from stratad.engine.sampling import Sampler, SamplingParams
from stratad.engine.timing import StageTimer
from stratad.model.tokenizer import StreamDecoder, Tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    pin: int = 0  # leading prompt tokens to keep as a pinned prefix snapshot


@dataclass
class GenerationEvent:
    """One step of output: the new token, the text it completes, and why generation ended."""

    token: int  # the sampled token (the end-of-sequence token too)
    text: str
    finish_reason: str | None = None  # "stop" | "length" | None while running


class Forward(Protocol):
    """What generation needs of a forward pass (the reference and the offload engine)."""

    def new_cache(self, max_len: int) -> KVCache: ...

    def __call__(
        self, tokens: list[int], cache: KVCache, all_logits: bool = False
    ) -> torch.Tensor: ...


class Generator:
    """Runs requests one at a time on a forward pass, reusing the KV of known prefixes."""

    def __init__(
        self,
        forward: Forward,
        tokenizer: Tokenizer,
        max_context: int,
        *,
        prefill_chunk: int = 128,
        prefix_store: PrefixStore | None = None,
    ) -> None:
        self.forward = forward
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.cache: KVCache = forward.new_cache(max_context)
        self.store = prefix_store if prefix_store is not None else PrefixStore(0, 0)
        self.cached_tokens = 0  # prompt tokens the last run reused instead of computing
        self.timer: StageTimer = getattr(forward, "timer", None) or StageTimer(enabled=False)

    def _reuse(self, prompt: list[int]) -> int:
        """Load the longest known prefix of `prompt` into the cache; return its length.

        At least the last prompt token is left to compute: its logits pick the first token.
        """
        live = self.cache.common_prefix(prompt)
        snap, n = self.store.best(prompt)
        keep = min(max(live, n), len(prompt) - 1)
        if min(live, keep) < self.cache.length:
            # the conversation in the cache is about to be overwritten: set it aside
            self.store.save(self.cache, self.cache.length)
        if snap is not None and n > live:
            self.store.restore(snap, keep, self.cache)
        else:
            self.cache.truncate(keep)
        return keep

    def _prefill(
        self, prompt: list[int], pin: int, cancelled: Callable[[], bool]
    ) -> torch.Tensor | None:
        """Logits [V] after the prompt, or None if cancelled between chunks."""
        pos = self.cached_tokens = self._reuse(prompt)
        if 0 < pin <= pos:
            self.store.save(self.cache, pin, pinned=True)
        logits = None
        while pos < len(prompt):
            if cancelled():
                return None
            end = min(pos + self.prefill_chunk, len(prompt))
            if pos < pin < end:
                end = pin  # a chunk ends at the pin, so its KV can be snapshotted as it is
            logits = self.forward(prompt[pos:end], self.cache)[-1]
            pos = end
            if pos == pin:
                self.store.save(self.cache, pin, pinned=True)
        assert logits is not None
        return logits

    def run(
        self, req: GenerationRequest, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationEvent]:
        if not req.prompt:
            raise ValueError("empty prompt")
        if len(req.prompt) + 1 > self.max_context:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens does not fit the context of {self.max_context}"
            )
        budget = min(req.max_tokens, self.max_context - len(req.prompt))
        sampler = Sampler(req.sampling)
        decoder = StreamDecoder(self.tokenizer)
        logits = self._prefill(req.prompt, req.pin, cancelled)
        if logits is None or cancelled():
            return
        text, emitted, n = "", 0, 0
        hold = max((len(s) for s in req.stop), default=0)
        while True:
            with self.timer.stage("sampling"):
                token = sampler.sample(logits)
            n += 1
            if token in self.tokenizer.eos_ids and not req.ignore_eos:
                yield GenerationEvent(token, text[emitted:] + decoder.flush(), "stop")
                return
            text += decoder.feed(token)
            cut = _find_stop(text, req.stop, max(emitted - hold, 0))
            if cut is not None:
                yield GenerationEvent(token, text[emitted:cut], "stop")
                return
            if n >= budget:
                yield GenerationEvent(token, text[emitted:] + decoder.flush(), "length")
                return
            # hold back text that could still turn into a stop string
            safe = len(text) - (hold - 1 if hold else 0)
            yield GenerationEvent(token, text[emitted:safe] if safe > emitted else "")
            emitted = max(emitted, safe)
            if cancelled():  # before spending a step on a token nobody will read
                return
            logits = self.forward([token], self.cache)[-1]


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    found = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(found) if found else None
