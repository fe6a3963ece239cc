"""The generation loop of one request: prefill, then decode until a stop condition."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from stratad.engine.forward import ReferenceForward
from stratad.engine.kv import KVCache
from stratad.engine.sampling import Sampler, SamplingParams
from stratad.model.tokenizer import StreamDecoder, Tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class GenerationEvent:
    """One step of output: the new token, the text it completes, and why generation ended."""

    token: int  # the sampled token (the end-of-sequence token too)
    text: str
    finish_reason: str | None = None  # "stop" | "length" | None while running


class Generator:
    """Runs requests one at a time on a forward pass, reusing the KV of a shared prefix."""

    def __init__(self, forward: ReferenceForward, tokenizer: Tokenizer, max_context: int) -> None:
        self.forward = forward
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.cache: KVCache = forward.new_cache(max_context)

    def _prefill(self, prompt: list[int]) -> list[int]:
        """Reuse the cached prefix; return the tokens still to be computed (at least one)."""
        keep = min(self.cache.common_prefix(prompt), len(prompt) - 1)
        self.cache.truncate(keep)
        return prompt[keep:]

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
        logits = self.forward(self._prefill(req.prompt), self.cache)[-1]
        text, emitted, n = "", 0, 0
        hold = max((len(s) for s in req.stop), default=0)
        while True:
            if cancelled():
                return
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
            logits = self.forward([token], self.cache)[-1]


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    found = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(found) if found else None
