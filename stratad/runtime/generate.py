"""Requests through the step loop, several at once, reusing the KV of known prefixes.

`Generator.start` admits a request as a `Sequence` on one of its working caches (`parallel`
of them, each holding blocks of one KV pool as far as its sequence reaches), after loading
the longest known prefix of its prompt (that cache's own, or a snapshot in the
`PrefixStore`). `step` advances every running sequence the step's plan picks
in one batched forward and returns what each got (an event, or the error that ended it);
`finish` ends a sequence (done, failed or cancelled) and gives its cache back. `pool` admits
an embedding request the same way (`stratad.runtime.pooling`): it computes its whole prompt on
the least recently used free cache and its one event is the pooled vector. The daemon's
engine thread calls exactly these, one step at a time (`stratad.runtime.service.Engine`).

For a caller with one request, or a test that interleaves a few: `turns` yields one
sequence's events, stepping the loop when it has none waiting (None: a step gave it none, a
prompt chunk); the others' events wait in their own queues until their callers ask.
`cancelled()` is polled before every step, so a cancelled request frees its cache within one.
A request whose own part of a step failed gets that error from `turns`; the others of the
step keep their events.
"""

from __future__ import annotations

import collections
import collections.abc
from collections.abc import Callable

from stratad.engine.kv import KVCache, KVPoolFull, pool_tokens, prompt_keys
from stratad.engine.timing import StageTimer
from stratad.model.text.tokenizer import Tokenizer
from stratad.runtime.pooling import Pooling, PoolingRequest
from stratad.runtime.prefix import PrefixStore, Snapshot
from stratad.runtime.sequence import GenerationEvent, GenerationRequest, Sequence
from stratad.runtime.speculation.cost import StepCost
from stratad.runtime.speculation.settings import Speculation
from stratad.runtime.step import Active, AheadPass, Forward, Outcome, StepLoop
from stratad.runtime.step_plan import StepBudget

# a request's events; closing it ends the request and frees its cache
Events = collections.abc.Generator[GenerationEvent, None, None]
# the same with None for a turn that stepped the loop and gave this request no event
Turns = collections.abc.Generator[GenerationEvent | None, None, None]


class Generator:
    """Runs requests on a forward pass, up to `parallel` at once, reusing known prefixes."""

    def __init__(
        self,
        forward: Forward,
        tokenizer: Tokenizer,
        max_context: int,
        *,
        prefill_chunk: int = 128,
        prefix_store: PrefixStore | None = None,
        parallel: int = 1,
        step_tokens: int = 0,
        kv_tokens: int = 0,
        speculation: Speculation | None = None,
        prompt_rows: tuple[int, int] = (0, 0),
        ahead: AheadPass | None = None,
        reuse: bool = True,
    ) -> None:
        """`step_tokens`: a step's tokens at most (`StepBudget.auto`: 0 is one prompt chunk
        beside a token of every running request); `kv_tokens`: the KV pool's tokens (0: the
        whole context of every working cache, so no request is ever preempted; at least one
        context); `speculation`: how each sequence drafts (None: it does not);
        `prompt_rows`: the rows of the forward's decode pass and the most tokens of a prompt
        it takes there (`Runner.prompt_rows`; short prompts wait for room there); `ahead`:
        the forward's decode step from tokens on the device (`Runner.ahead`: decode steps
        of plain draws queue the next one before the host reads their tokens); `reuse`
        False (a recurrent model, whose state cannot be cut back to a shared prefix): no
        shared blocks; a request continues a conversation, its working cache's or a
        snapshot's, only where all of it starts the prompt (`_continue`), else computes its
        whole prompt on an emptied cache."""
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.forward = forward
        self.reuse = reuse
        self.speculation = speculation
        self.tokenizer = tokenizer
        self.max_context = max_context
        # one pool of KV blocks that every working cache takes from as its sequence grows
        full = pool_tokens(parallel, max_context)
        self.kv = forward.new_pool(max(kv_tokens or full, pool_tokens(1, max_context)))
        self.caches: list[KVCache] = [KVCache(self.kv, max_context) for _ in range(parallel)]
        self.store = prefix_store if prefix_store is not None else PrefixStore(0, 0)
        self._scopes = [""] * parallel  # whose conversation each working cache holds
        self._used = [0] * parallel  # when each cache was last taken, for least-recently-used
        self._taken = 0
        self.cached_tokens = 0  # prompt tokens the last request started reused, not computed
        self._owner: dict[int, Active] = {}  # cache index -> the sequence running on it
        self._waiting: dict[Active, collections.deque[Outcome]] = {}
        self.timer: StageTimer = getattr(forward, "timer", None) or StageTimer(enabled=False)
        budget = StepBudget.auto(prefill_chunk, parallel, step_tokens, *prompt_rows)
        cost = StepCost(speculation.token_cost) if speculation is not None else None
        self.loop = StepLoop(forward, budget, self.store, self.kv, self.timer, idle=self,
                             cost=cost, ahead=ahead)  # fmt: skip

    @property
    def cache(self) -> KVCache:
        """The first working cache (the only one with `parallel` 1)."""
        return self.caches[0]

    @property
    def free(self) -> int:
        """Working caches no running request holds."""
        return len(self.caches) - len(self._owner)

    def _pick(self, prompt: list[int], scope: str) -> int:
        """A free cache: the one whose own conversation shares most of `prompt`, else the one
        taken longest ago."""
        free = [i for i in range(len(self.caches)) if i not in self._owner]
        if not free:
            raise RuntimeError(f"all {len(self.caches)} working caches are in use")

        def live(i: int) -> int:
            return self.caches[i].common_prefix(prompt) if self._scopes[i] == scope else 0

        return max(free, key=lambda i: (live(i), -self._used[i]))

    def _idle(self) -> list[int]:
        """The working caches no sequence of the loop runs on (free ones, and those whose
        sequence ended but whose caller has not yet called `finish`), least recently taken
        first."""
        running = {id(s) for s in self.loop.running}
        idle = [i for i in range(len(self.caches)) if id(self._owner.get(i)) not in running]
        return sorted(idle, key=lambda i: self._used[i])

    def idle_blocks(self) -> int:
        """Blocks the idle working caches alone keep (their conversations)."""
        return sum(self.caches[i].own_blocks() for i in self._idle())

    def reclaim(self, blocks: int, keep: int = -1) -> None:
        """Give back at least `blocks` blocks of idle working caches (all but cache `keep`),
        least recently taken first, each conversation set aside in the prefix store first."""
        idle = [i for i in self._idle() if i != keep]
        for i in idle:
            if blocks <= 0:
                return
            cache = self.caches[i]
            if cache.blocks:
                blocks -= cache.own_blocks()
                self.store.save(cache, cache.length, scope=self._scopes[i])
                cache.release()

    def _reuse(self, i: int, prompt: list[int], scope: str) -> int:
        """Load the longest prefix of `prompt` known in `scope` into cache i; its length.

        At least the last prompt token is left to compute: its logits pick the first token.
        """
        cache = self.caches[i]
        live = cache.common_prefix(prompt) if scope == self._scopes[i] else 0
        if not self.reuse:
            return self._continue(i, live, prompt, scope)
        snap, n = self.store.best(prompt, scope)
        keep = min(max(live, n), len(prompt) - 1)
        # full blocks of the pool that hold this prompt's start (this cache's or another's)
        keys = prompt_keys(prompt[: len(prompt) - 1], scope, self.kv.block_size)
        shared = self.kv.lookup(keys)
        if len(shared) * self.kv.block_size > keep:
            if live < cache.length:
                self.store.save(cache, cache.length, scope=self._scopes[i])
            self._scopes[i] = scope
            cache.release()
            n = len(shared) * self.kv.block_size
            cache.adopt(shared, keys[: len(shared)], prompt[:n])
            return n
        if min(live, keep) < cache.length:
            # the conversation in the cache is about to be overwritten: set it aside
            self.store.save(cache, cache.length, scope=self._scopes[i])
        self._scopes[i] = scope
        if snap is not None and n > live:
            return self._restore(i, snap, keep)
        cache.truncate(keep)
        return keep

    def _continue(self, i: int, live: int, prompt: list[int], scope: str) -> int:
        """A recurrent model's prefix in cache i, its state standing for whole prefixes alone:
        the cache's whole conversation where it starts the prompt and leaves a token to
        compute (a conversation's next turn), unless a snapshot of `scope` holds more of it
        (`Snapshot.reusable`: all of its tokens); else that snapshot restored, the cache's own
        conversation set aside first; else none, the cache emptied."""
        cache = self.caches[i]
        state = cache.recurrent
        whole = 0 < live == cache.length < len(prompt)
        whole = whole and state is not None and state.length == live
        snap, n = self.store.best(prompt, scope)
        if whole and n <= live:
            self._scopes[i] = scope
            return live
        if cache.length:
            self.store.save(cache, cache.length, scope=self._scopes[i])
        cache.release()
        self._scopes[i] = scope
        return self._restore(i, snap, n) if snap is not None and n else 0

    def _restore(self, i: int, snap: Snapshot, length: int) -> int:
        """Cache i holds the snapshot's first `length` tokens, idle caches' blocks reclaimed
        for it; `length`, or 0 (the cache emptied) where running requests hold the pool."""
        cache = self.caches[i]
        want = self.kv.blocks_for(length) - self.kv.free_blocks - len(cache.blocks)
        if want > 0:
            self.reclaim(want, keep=i)
        try:
            self.store.restore(snap, length, cache)
        except KVPoolFull:  # compute the prompt instead
            cache.release()
            return 0
        return length

    def start(self, req: GenerationRequest) -> Sequence:
        """Admit `req` on a free working cache; its `Sequence` (`cached_tokens`: the prompt
        tokens reused instead of computed). Follow with `turns` or `events`, which give the cache
        back when they end or are closed."""
        if not req.prompt:
            raise ValueError("empty prompt")
        if len(req.prompt) + 1 > self.max_context:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens does not fit the context of {self.max_context}"
            )
        i = self._pick(req.prompt, req.scope)
        pos = self._reuse(i, req.prompt, req.scope)
        if 0 < req.pin <= pos:
            self.store.save(self.caches[i], req.pin, pinned=True, scope=req.scope)
        seq = Sequence(req, self.caches[i], self.tokenizer, self.max_context)
        seq.cached_tokens = self.cached_tokens = pos
        if self.speculation is not None:
            seq.speculate(*self.speculation.start(req.prompt, req.scope))
        self._admit(i, seq)
        return seq

    def pool(self, req: PoolingRequest) -> Pooling:
        """Admit an embedding request on the free working cache taken longest ago (it reuses
        no prefix: every token's hidden state is pooled); its `Pooling`, which `step` advances
        like a sequence until its one event. The conversation that cache held is set aside
        first, as for any request; the prompt's KV stays there for the next one of `scope`."""
        if len(req.prompt) > self.max_context:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens does not fit the context of {self.max_context}"
            )
        i = self._pick([], req.scope)
        cache = self.caches[i]
        if cache.length:
            self.store.save(cache, cache.length, scope=self._scopes[i])
        cache.truncate(0)
        self._scopes[i] = req.scope
        seq = Pooling(req, cache, self.max_context)
        self.cached_tokens = 0
        self._admit(i, seq)
        return seq

    def _admit(self, i: int, seq: Active) -> None:
        """`seq` runs on working cache i from the next step."""
        self._taken += 1
        self._used[i] = self._taken
        self._owner[i] = seq
        self._waiting[seq] = collections.deque()  # for `turns`
        self.loop.add(seq)

    def turns(self, seq: Sequence, cancelled: Callable[[], bool] = lambda: False) -> Turns:
        """`seq`'s events until it stops, is cancelled, or the iterator is closed; then its
        cache is free again (its KV kept for the next request of the same conversation).
        None: this turn ran a step that gave `seq` no event (a chunk of its prompt)."""
        try:
            waiting = self._waiting[seq]
            while not cancelled():
                if not waiting:
                    for s, outcome in self.step():
                        self._waiting[s].append(outcome)
                    if not waiting:
                        yield None
                    continue
                event = waiting.popleft()
                if isinstance(event, Exception):  # its own part of a step failed
                    raise event
                assert isinstance(event, GenerationEvent), "turns are a generating sequence's"
                if seq.sampled == 1 and cancelled():  # cancelled during the prompt
                    return
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.finish(seq)

    def events(self, seq: Sequence, cancelled: Callable[[], bool] = lambda: False) -> Events:
        """`turns` without the empty ones."""
        turns = self.turns(seq, cancelled)
        try:
            yield from (event for event in turns if event is not None)
        finally:
            turns.close()

    def run(self, req: GenerationRequest, cancelled: Callable[[], bool] = lambda: False) -> Events:
        """`start` then `events`: one request's events (nothing is admitted before the first
        is asked for)."""
        yield from self.events(self.start(req), cancelled)

    def step(self) -> list[tuple[Active, Outcome]]:
        """One step: the outcome of every sequence that sampled a token or failed in it. A
        sequence that finished or failed has left the loop; `finish` gives its cache back.
        If the forward itself fails, every running sequence's cache is forgotten (what the
        step wrote is not known) and the error raised: the caller ends them all."""
        try:
            return self.loop.step()
        except Exception:
            for s in self.loop.running:
                s.cache.truncate(0)
            raise

    def finish(self, seq: Active) -> None:
        """`seq` ends (done, failed or cancelled): its cache is free again, its KV kept for
        the next request of the same conversation. Idempotent."""
        if seq in self.loop.running:
            self.loop.remove(seq)
        self._waiting.pop(seq, None)
        for i, s in list(self._owner.items()):
            if s is seq:
                del self._owner[i]
