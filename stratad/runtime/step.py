"""The generation loop as one step: schedule -> forward(batch) -> sample and update.

`StepLoop` holds the running sequences. Each `step` gives every one of them its next tokens
(a prompt chunk, or the token sampled last), runs one batched forward over all of them
(`Forward.step`: B sequences, each its own KV cache), then samples each sequence whose
prompt is done and records pinned prefixes. A sequence that finished leaves the loop; its
cache is the caller's again.
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs
from typing import Protocol

import torch

from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache
from stratad.engine.prefix import PrefixStore
from stratad.engine.timing import StageTimer
from stratad.runtime.sequence import GenerationEvent, Sequence


class Forward(Protocol):
    """What generation needs of a forward pass (the reference and the offload engine)."""

    def new_cache(self, max_len: int) -> KVCache: ...

    def step(self, seqs: Seqs[Seq]) -> list[torch.Tensor]: ...


class StepLoop:
    def __init__(
        self,
        forward: Forward,
        prefill_chunk: int,
        prefixes: PrefixStore,
        timer: StageTimer | None = None,
    ) -> None:
        self.forward, self.prefill_chunk, self.prefixes = forward, prefill_chunk, prefixes
        self.timer = timer or StageTimer(enabled=False)
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if any(s.cache is seq.cache for s in self.running):
            raise ValueError("a KV cache can serve one running sequence at a time")
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        self.running.remove(seq)

    def step(self) -> list[tuple[Sequence, GenerationEvent]]:
        """Advance every running sequence once: the events of those that sampled a token
        (a sequence still in its prompt samples nothing); finished ones leave the loop."""
        seqs = list(self.running)
        if not seqs:
            return []
        batch = [Seq(s.cache, s.next_tokens(self.prefill_chunk)) for s in seqs]
        logits = self.forward.step(batch)
        events = []
        for s, b, lg in zip(seqs, batch, logits, strict=True):
            if s.prefilling:
                s.computed(len(b.tokens))
                if s.pos == s.req.pin:  # a chunk ends at the pin: snapshot its KV as it is
                    self.prefixes.save(s.cache, s.pos, pinned=True, scope=s.req.scope)
                if s.prefilling:
                    continue
            with self.timer.stage("sampling"):
                event = s.sample(lg[-1])
            events.append((s, event))
            if event.finish_reason is not None:
                self.running.remove(s)
        return events
