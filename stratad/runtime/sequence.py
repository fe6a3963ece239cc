"""One request's generation as state a step advances: the prompt still to compute, then one
sampled token per step until a stop condition.

A `Sequence` owns its KV cache while it runs. `next_tokens` says what its next forward
computes (a chunk of the prompt, or the last sampled token); `computed` records that the
forward ran; `sample` turns the logits of its last position into the next `GenerationEvent`
(the token, the text it completes, and why generation ended). `preempt` gives its KV blocks
back to the pool: it then recomputes its prompt and the tokens it has sampled (all but the
last, which its next decode computes), and goes on where it was, its sampler's state intact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stratad.engine.batch import Output
from stratad.engine.kv import KVCache
from stratad.engine.recurrent import RecurrentState
from stratad.model.text.tokenizer import StreamDecoder, Tokenizer
from stratad.runtime.grammar import Constraint
from stratad.runtime.sampling import Sample, Sampler, SamplingParams
from stratad.runtime.speculation.drafter import Drafts
from stratad.runtime.speculation.length import DraftLength


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    pin: int = 0  # leading prompt tokens to keep as a pinned prefix snapshot
    scope: str = ""  # whose prefixes it may reuse (and its own are kept under)
    grammar: str | None = None  # llguidance's grammar the output must follow


@dataclass
class GenerationEvent:
    """One step of output: the new token, the text it completes, and why generation ended."""

    token: int  # the sampled token (the end-of-sequence token too)
    text: str
    finish_reason: str | None = None  # "stop" | "length" | None while running
    sample: Sample | None = None  # the draw, with its logprobs if the request asked
    stopping_word: str = ""  # the stop string that ended it, if one did


class Sequence:
    out = Output.NEXT  # what it asks of each forward: the logits its next token is drawn from

    def __init__(
        self, req: GenerationRequest, cache: KVCache, tokenizer: Tokenizer, max_context: int
    ) -> None:
        """`cache` already holds the first `cache.length` prompt tokens (a reused prefix)."""
        if not req.prompt:
            raise ValueError("empty prompt")
        if len(req.prompt) + 1 > max_context:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens does not fit the context of {max_context}"
            )
        self.req, self.cache = req, cache
        self.pos = cache.length  # prompt tokens in the cache
        self.budget = min(req.max_tokens, max_context - len(req.prompt))
        self.sampler = Sampler(req.sampling)
        self.constraint = Constraint(tokenizer, req.grammar) if req.grammar else None
        self.decoder = StreamDecoder(tokenizer)
        self.eos = tokenizer.eos_ids
        self.hold = max((len(s) for s in req.stop), default=0)
        self.text, self.emitted, self.sampled = "", 0, 0
        self.token: int | None = None  # the last sampled token, not yet in the cache
        self.generated: list[int] = []  # every sampled token
        self.context = req.prompt  # the tokens its cache must hold before it decodes
        self.resuming = False  # recomputing its context after a preemption: samples nothing
        self.preemptions = 0
        # speculative decoding: this sequence's drafter and draft length (None: off), and the
        # tokens drafted for the step under way
        self.drafts: Drafts | None = None
        self.draft_length: DraftLength | None = None
        self.proposed: list[int] = []
        # a recurrent model's state before the pass that verifies `proposed` (it folds in
        # every draft; a rejected one is undone by going back to this)
        self.rewind: RecurrentState | None = None
        self.drafted = self.accepted = 0
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens reused from a known prefix, not computed

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.context)

    def next_tokens(self, chunk: int) -> list[int]:
        """What the next forward computes: up to `chunk` prompt tokens (a chunk ends at the
        pin, so that its KV can be snapshotted as it is), else the last sampled token."""
        if self.prefilling:
            end = min(self.pos + chunk, len(self.context))
            if self.pos < self.req.pin < end:
                end = self.req.pin
            return self.context[self.pos : end]
        assert self.token is not None
        return [self.token, *self.proposed]

    def speculate(self, drafts: Drafts, length: DraftLength) -> None:
        """Draft tokens from `drafts` at every decode from now on (fed the prompt already)."""
        self.drafts, self.draft_length = drafts, length

    def draft_size(self, token_cost: float) -> int:
        """How many tokens to draft this step after the pending one, a drafted token costing
        `token_cost` of a decode step (none while in the prompt, where the draft would not
        pay, or where the budget or the cache has no room for them); this step's proposal
        is cleared until `proposed` is set (`speculation.drafter.propose_all`)."""
        self.proposed = []
        if self.drafts is None or self.draft_length is None or self.prefilling:
            return 0
        room = min(self.budget - self.sampled - 1, self.cache.capacity - self.cache.length - 1)
        return max(min(self.draft_length.next(token_cost), room), 0)

    def checkpoint(self) -> None:
        """Before a pass that verifies drafts: a recurrent model's state copied (`rewind`)."""
        state = self.cache.recurrent
        self.rewind = state.copy() if self.proposed and state is not None else None

    def verify(self, logits: torch.Tensor) -> list[GenerationEvent]:
        """The events of a step that computed the pending token and the drafts (logits
        [1 + len(proposed), V]): each position sampled in turn, the draft checked, up to the
        first token that differs from it (or ends the sequence) and the one after the last
        draft. The cache keeps the tokens the events settled; a recurrent model's, whose state
        folded in every draft, goes back to its `checkpoint` where one was rejected, and the
        next step computes the tokens that stood again (as a prompt chunk ending at the new
        pending token: its logits draw the next)."""
        drafts, length = self.proposed, self.cache.length - len(self.proposed) - 1
        events: list[GenerationEvent] = []
        for j in range(len(drafts) + 1):
            draft = drafts[j] if j < len(drafts) else None
            events.append(self.sample(logits[j]))  # the draft stands where it is this token
            if events[-1].finish_reason is not None or draft is None:
                break
            if events[-1].token != draft:
                break
        accepted = sum(1 for d, e in zip(drafts, events, strict=False) if e.token == d)
        self.drafted += len(drafts)
        self.accepted += accepted
        if drafts and self.draft_length is not None:  # event j < len(drafts) checked draft j
            self.draft_length.record(min(len(events), len(drafts)), accepted)
        # the KV of the pending token and the drafts that stood; the new pending token's next
        kept, rewind, self.rewind = length + len(events), self.rewind, None
        if rewind is not None and kept < self.cache.length:
            self.cache.truncate(length)
            self.cache.recurrent = rewind
            self.pos, self.context = length, self.req.prompt + self.generated
        else:
            self.cache.truncate(kept)
        self.proposed = []
        return events

    def computed(self, n: int) -> None:
        """The forward appended `n` prompt tokens that `next_tokens` gave; after the last of a
        resumption's, its next step decodes the pending token."""
        self.pos += n
        if self.resuming and not self.prefilling:
            self.resuming = False

    def preempt(self) -> None:
        """Give the KV blocks back: the prompt and every sampled token but the pending one
        are computed again before it decodes on."""
        self.cache.release()
        self.pos = 0
        self.proposed = []
        self.context = self.req.prompt + self.generated[:-1]
        self.resuming = bool(self.generated)
        self.preemptions += 1

    def sample(self, logits: torch.Tensor, drawn: Sample | None = None) -> GenerationEvent:
        """The next event from the logits [V] of the last position (`drawn`: the token drawn
        from them already, with the other sequences of the step)."""
        if drawn is None:
            allowed = self.constraint.allowed() if self.constraint else None
            drawn = self.sampler.draw(logits, allowed)
        token = self.token = drawn.token
        self.generated.append(token)
        if self.drafts is not None:
            self.drafts.extend([token])
        if self.constraint is not None:
            self.constraint.accept(token)
        self.sampled += 1
        if token in self.eos and not self.req.ignore_eos:
            return self._end(drawn, self.text[self.emitted :] + self.decoder.flush(), "stop")
        self.text += self.decoder.feed(token)
        found = _find_stop(self.text, self.req.stop, max(self.emitted - self.hold, 0))
        if found is not None:
            cut, word = found
            return self._end(drawn, self.text[self.emitted : cut], "stop", word)
        if self.sampled >= self.budget:
            return self._end(drawn, self.text[self.emitted :] + self.decoder.flush(), "length")
        # hold back text that could still turn into a stop string
        safe = len(self.text) - (self.hold - 1 if self.hold else 0)
        text = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return GenerationEvent(token, text, sample=drawn)

    def _end(self, drawn: Sample, text: str, reason: str, word: str = "") -> GenerationEvent:
        self.finish_reason = reason
        return GenerationEvent(drawn.token, text, reason, drawn, word)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """Where the first stop string in `text` (from `start` on) begins, and which it is."""
    found = [(i, s) for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(found) if found else None
