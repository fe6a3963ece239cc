"""One request at a time through the step loop, reusing the KV of known prefixes.

`Generator.run` admits a request as a `Sequence` on the working cache, after loading the
longest known prefix of its prompt (the working cache's own, or a snapshot in the
`PrefixStore`), then steps the loop until the sequence stops. `cancelled()` is polled before
every step (a prompt chunk or a decoded token), so a cancelled request frees the engine
within one of either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from stratad.engine.kv import KVCache
from stratad.engine.prefix import PrefixStore
from stratad.engine.timing import StageTimer
from stratad.model.tokenizer import Tokenizer
from stratad.runtime.sequence import GenerationEvent, GenerationRequest, Sequence
from stratad.runtime.step import Forward, StepLoop


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
        self.cache: KVCache = forward.new_cache(max_context)
        self.store = prefix_store if prefix_store is not None else PrefixStore(0, 0)
        self.cached_tokens = 0  # prompt tokens the last run reused instead of computing
        self._scope = ""  # whose conversation the working cache holds
        self.timer: StageTimer = getattr(forward, "timer", None) or StageTimer(enabled=False)
        self.loop = StepLoop(forward, prefill_chunk, self.store, self.timer)

    def _reuse(self, prompt: list[int], scope: str) -> int:
        """Load the longest prefix of `prompt` known in `scope` into the cache; its length.

        At least the last prompt token is left to compute: its logits pick the first token.
        """
        live = self.cache.common_prefix(prompt) if scope == self._scope else 0
        snap, n = self.store.best(prompt, scope)
        keep = min(max(live, n), len(prompt) - 1)
        if min(live, keep) < self.cache.length:
            # the conversation in the cache is about to be overwritten: set it aside
            self.store.save(self.cache, self.cache.length, scope=self._scope)
        self._scope = scope
        if snap is not None and n > live:
            self.store.restore(snap, keep, self.cache)
        else:
            self.cache.truncate(keep)
        return keep

    def run(
        self, req: GenerationRequest, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationEvent]:
        if not req.prompt:
            raise ValueError("empty prompt")
        if len(req.prompt) + 1 > self.max_context:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens does not fit the context of {self.max_context}"
            )
        pos = self.cached_tokens = self._reuse(req.prompt, req.scope)
        if 0 < req.pin <= pos:
            self.store.save(self.cache, req.pin, pinned=True, scope=req.scope)
        seq = Sequence(req, self.cache, self.tokenizer, self.max_context)
        self.loop.add(seq)
        try:
            while not cancelled():
                for _, event in self.loop.step():
                    if seq.sampled == 1 and cancelled():  # cancelled during the prompt
                        return
                    yield event
                    if event.finish_reason is not None:
                        return
        finally:
            if seq in self.loop.running:
                self.loop.remove(seq)
