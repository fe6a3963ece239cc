"""The generation loop as one step: schedule -> forward(batch) -> sample and update.

`StepLoop` holds the running sequences: generating `Sequence`s, and `Pooling`s (embedding
requests, which compute their prompt and pool its hidden states instead of sampling). Each
`step` plans what each computes (`plan_step`: every decoding sequence's token, then prompt
chunks in arrival order within the step's budget; `plan_blocks`: the KV blocks those need,
idle caches' blocks reclaimed and the youngest sequences preempted when the pool runs
short), takes the blocks, runs one batched forward over those
(`Forward.step`: B sequences, each its own KV cache), then samples each sequence whose
prompt is done, records pinned prefixes, and pools the poolings' rows. A sequence that
finished leaves the loop; its cache is the caller's again. A sequence whose
own part of the step fails (its grammar refuses, its sampler raises) leaves the loop with
that error as its outcome; the others' outcomes of the same step stand, so one request's
failure never changes another's tokens.

Where the forward offers it (`ahead`: a GPU replaying its decode graph), a step in which
every running sequence decodes with the sampling filters alone (greedy or tempered) draws its
tokens on the device and queues the next step from them there before the host reads them:
the device computes step N+1 while the host samples, streams and plans step N, and the next
`step` takes that step's logits. A sequence that finishes or leaves meanwhile gives the
queued token's KV back; one that arrives meanwhile joins the step after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seqs
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stratad.engine.batch import Output, Seq
from stratad.engine.kv import KVCache, KVPool, KVPoolFull, prompt_keys
from stratad.engine.timing import StageTimer
from stratad.host_copy import HostCopy
from stratad.runtime.kv_plan import plan_blocks
from stratad.runtime.pooling import PooledEvent, Pooling
from stratad.runtime.prefix import PrefixStore
from stratad.runtime.sampling import (
    Sample,
    SamplingParams,
    draw_on_device,
    draw_rows,
    drawn_token,
)
from stratad.runtime.sequence import GenerationEvent, Sequence
from stratad.runtime.speculation.cost import DEFAULT_TOKEN_COST, StepCost
from stratad.runtime.speculation.drafter import propose_all
from stratad.runtime.step_plan import StepBudget, Want, plan_step

log = logging.getLogger("stratad.engine")

# a request in the loop: one that generates, or one that pools its prompt (an embedding)
Active = Sequence | Pooling
# what a step gave one of them: its next event, or the error that ended it
Outcome = GenerationEvent | PooledEvent | Exception


class Forward(Protocol):
    """What generation needs of a forward pass (the reference and the offload engine)."""

    def new_pool(self, tokens: int) -> KVPool:
        """A pool of KV blocks for at least `tokens` tokens in all."""
        ...

    def step(self, seqs: Seqs[Seq]) -> list[torch.Tensor]: ...


def _decoding(seqs: list[Active]) -> int | None:
    """The drafted tokens of a step where every sequence computes its next token and its
    drafts only (None: a step with prompt tokens or pooling, whose time says nothing of a
    draft's cost)."""
    if not all(isinstance(s, Sequence) and not s.prefilling for s in seqs):
        return None
    return sum(len(s.proposed) for s in seqs if isinstance(s, Sequence))


def _wants(s: Active) -> Output:
    """What a sequence asks of this step's forward: every new token's logits to verify a
    draft, else its own kind."""
    return Output.LOGITS if isinstance(s, Sequence) and s.proposed else s.out


# the forward's decode pass of each cache's next token given on the device, queued without
# the host reading it (`engine.batch.run_ahead`): logits [R, V]
AheadPass = Callable[[list[KVCache], torch.Tensor], torch.Tensor]


@dataclass
class _Ahead:
    """A step queued before the host read the tokens it computes: row i is `seqs[i]`'s."""

    seqs: list[Sequence]
    logits: torch.Tensor
    gone: set[int] = field(default_factory=set)  # ids of those that left the loop since


class Idle(Protocol):
    """The caches no running sequence holds, whose blocks a step may take back."""

    def idle_blocks(self) -> int: ...

    def reclaim(self, blocks: int) -> None:
        """Give back at least `blocks` blocks of idle caches (their KV set aside first)."""
        ...


class _NoIdle:
    def idle_blocks(self) -> int:
        return 0

    def reclaim(self, blocks: int) -> None:
        pass


class StepLoop:
    def __init__(
        self,
        forward: Forward,
        budget: StepBudget,
        prefixes: PrefixStore,
        kv: KVPool,
        timer: StageTimer | None = None,
        idle: Idle | None = None,
        cost: StepCost | None = None,
        ahead: AheadPass | None = None,
    ) -> None:
        """`cost`: what a drafted token costs, measured on these steps (a prior of
        `DEFAULT_TOKEN_COST` where not given). `ahead`: where given, a step of plain
        decodes only (`_can_launch_ahead`) queues the next step from its tokens on the device
        before the host reads them, so that the device computes that step while the host
        samples, streams and plans (`_launch_ahead`)."""
        self.forward, self.budget, self.prefixes, self.kv = forward, budget, prefixes, kv
        self.cost = cost or StepCost(DEFAULT_TOKEN_COST)
        self.timer = timer or StageTimer(enabled=False)
        self.idle: Idle = idle or _NoIdle()
        self.running: list[Active] = []
        self.preempted = 0  # preemptions so far
        self.resumed_tokens = 0  # tokens preempted sequences found still in the pool
        self.drafted = self.accepted = self.verifies = 0  # speculative decoding so far
        self.ahead = ahead
        self._ahead: _Ahead | None = None  # the step queued ahead, not yet taken
        self.ahead_steps = 0  # steps queued ahead so far
        self.ahead_taken_back = 0  # of them, taken back for a draw the device could not finish

    def add(self, seq: Active) -> None:
        if seq.cache.pool is not self.kv:
            raise ValueError("a sequence's cache must hold blocks of the loop's KV pool")
        if any(s.cache is seq.cache for s in self.running):
            raise ValueError("a KV cache can serve one running sequence at a time")
        self.running.append(seq)

    def remove(self, seq: Active) -> None:
        self.running.remove(seq)
        self._drop_ahead(seq)

    def _drop_ahead(self, seq: Active) -> None:
        """A sequence leaving the loop gives back the token a step queued ahead computed
        for it: its cache ends where its last sampled token's KV ends."""
        ahead = self._ahead
        if ahead is not None and any(q is seq for q in ahead.seqs) and id(seq) not in ahead.gone:
            ahead.gone.add(id(seq))
            seq.cache.truncate(seq.cache.length - 1)

    def step(self) -> list[tuple[Active, Outcome]]:
        """Advance the running sequences the plan picks: the outcomes of those that sampled a
        token (a sequence still in its prompt samples nothing) or failed; finished and failed
        ones leave the loop."""
        if self._ahead is not None:
            return self._step_ahead()
        if not self.running:
            return []
        start = time.perf_counter()  # a draft model's passes are part of a draft's cost
        # drafts first: a verify's tokens count in the plan
        sizes = [(q, q.drafts, q.draft_size(self.cost.token_cost)) for q in self.running
                 if isinstance(q, Sequence)]  # fmt: skip
        asks = [(q, d, k) for q, d, k in sizes if d is not None and k > 0]
        try:
            drafts = propose_all([(d, k) for _, d, k in asks])
        except Exception:  # noqa: BLE001 (drafts are a guess: a failing drafter drafts nothing)
            log.warning("drafting failed; this step verifies no drafts", exc_info=True)
            drafts = [[] for _ in asks]
        for (q, _, _), proposed in zip(asks, drafts, strict=True):
            q.proposed = proposed
        out: list[tuple[Active, Outcome]] = []
        picked, nexts = self._plan(out)
        if not picked:
            return out
        seqs = [self.running[i] for i in picked]
        batch = [Seq(s.cache, nexts[i], _wants(s)) for i, s in zip(picked, seqs, strict=True)]
        timed = _decoding(seqs)  # drafted tokens in all, or None: a step of prompt tokens
        for s in seqs:
            if isinstance(s, Sequence):
                s.checkpoint()
        rows = self.forward.step(batch)  # it takes the planned blocks (`engine.batch.reserve`)
        for s in seqs:  # full blocks become hits for later prompts of the same scope
            s.cache.seal(s.req.scope)
        settled: list[tuple[Sequence, torch.Tensor]] = []  # those that sample this step
        for s, b, r in zip(seqs, batch, rows, strict=True):
            try:
                if isinstance(s, Pooling):
                    self._emit(out, s, [s.pool(r)])
                elif self._settle(s, len(b.tokens)):
                    settled.append((s, r))
            except Exception as err:  # noqa: BLE001 (its own failure ends this sequence alone)
                self._fail(out, s, err)
        self._sample_all(out, settled)
        if timed is not None:  # drafting, the forward and the sampling: what a step costs
            self.cost.observe(len(seqs), timed, time.perf_counter() - start)
        return out

    def _step_ahead(self) -> list[tuple[Active, Outcome]]:
        """A step whose forward was queued ahead: the logits of those of its sequences still
        in the loop (a request that arrived since waits for the next step)."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        settled = [(s, ahead.logits[i : i + 1]) for i, s in enumerate(ahead.seqs)
                   if id(s) not in ahead.gone]  # fmt: skip
        if not settled:
            return self.step()
        for s, _ in settled:
            s.cache.seal(s.req.scope)
        out: list[tuple[Active, Outcome]] = []
        self._sample_all(out, settled)
        return out

    def _sample_all(
        self, out: list[tuple[Active, Outcome]], settled: list[tuple[Sequence, torch.Tensor]]
    ) -> None:
        """Each settled sequence's events from its logits (`_draw`, then `_sample`)."""
        drawn = self._draw(settled)
        for s, r in settled:
            try:
                with self.timer.stage("sampling"):
                    events = self._sample(s, r, drawn)
            except Exception as err:  # noqa: BLE001 (its own failure ends this sequence alone)
                self._fail(out, s, err)
                continue
            self._emit(out, s, events)

    def _plan(self, out: list[tuple[Active, Outcome]]) -> tuple[list[int], list[list[int]]]:
        """The running sequences that compute this step (and every running one's next
        tokens), their blocks made free: idle caches' blocks reclaimed, the youngest
        sequences preempted where the plan says. A lone sequence the pool cannot hold fails
        (`out`)."""
        for s in self.running:
            if isinstance(s, Sequence) and s.resuming and not s.cache.blocks:
                self._resume_from_blocks(s)
        nexts = [s.next_tokens(self.budget.chunk) for s in self.running]
        wants = [
            Want(len(t), not s.prefilling, s.cache.blocks_to_add(len(t)), s.cache.own_blocks())
            for s, t in zip(self.running, nexts, strict=True)
        ]
        picked = plan_step(wants, self.budget)
        plan = plan_blocks(wants, picked, self.kv.free_blocks + self.idle.idle_blocks())
        for i in plan.preempt:
            s = self.running[i]
            log.info("KV pool full: a request gives its %d blocks back and recomputes its %d"
                     " tokens later", len(s.cache.blocks), s.cache.length)  # fmt: skip
            s.preempt()
            self.preempted += 1
        need = sum(wants[i].blocks for i in plan.run) - self.kv.free_blocks
        if need > 0:
            self.idle.reclaim(need)
        if not plan.run:  # nothing fits even alone: the oldest fails, the others go on
            s = self.running.pop(0)
            pool = f"{self.kv.n_blocks} blocks of {self.kv.block_size} tokens"
            out.append((s, KVPoolFull(f"the KV pool ({pool}) cannot hold this request")))
        return plan.run, nexts  # a preempted sequence's are stale, and it does not run

    def _resume_from_blocks(self, s: Sequence) -> None:
        """A preempted sequence starts again from those of its blocks still registered in
        the pool (what it gave back and nobody took since), not from its first token."""
        bs = self.kv.block_size
        keys = prompt_keys(s.context[: len(s.context) - 1], s.req.scope, bs)
        shared = self.kv.lookup(keys)
        if shared:
            n = len(shared) * bs
            s.cache.adopt(shared, keys[: len(shared)], s.context[:n])
            s.pos = n
            self.resumed_tokens += n

    def _emit(
        self, out: list[tuple[Active, Outcome]], s: Active, events: Seqs[Outcome | None]
    ) -> None:
        for event in events:
            if event is None:
                continue
            out.append((s, event))
            if not isinstance(event, Exception) and event.finish_reason is not None:
                self.remove(s)

    def _fail(self, out: list[tuple[Active, Outcome]], s: Active, err: Exception) -> None:
        self.remove(s)
        out.append((s, err))

    def _settle(self, s: Sequence, n: int) -> bool:
        """Sequence s after the step computed its n tokens: whether it samples now (not for
        a prompt chunk short of the prompt's end, nor at the end of a resumption's
        recompute, whose pending token decodes next)."""
        if s.prefilling:
            resuming = s.resuming
            s.computed(n)
            if s.pos == s.req.pin:  # a chunk ends at the pin: snapshot its KV as it is
                self.prefixes.save(s.cache, s.pos, pinned=True, scope=s.req.scope)
            if s.prefilling or resuming:
                return False
        return True

    def _draw(self, settled: list[tuple[Sequence, torch.Tensor]]) -> dict[int, int | None]:
        """The tokens of the step's plain draws (no drafts to verify, no grammar, no bias,
        penalties or log-probabilities), drawn together: one transfer from the device, not
        one each (`draw_rows`); by the sequence's id. A failure here leaves each to draw
        alone."""
        plain = [(s, r) for s, r in settled
                 if not s.proposed and s.constraint is None and s.sampler.plain]  # fmt: skip
        if not plain:
            return {}
        seqs = [s for s, _ in plain]
        logits = torch.cat([r[-1:] for _, r in plain])
        params = [s.sampler.params for s in seqs]
        uniforms = [s.sampler.uniform() for s in seqs]
        try:
            if self._can_launch_ahead(plain):
                tokens = self._launch_ahead(seqs, logits, params, uniforms)
            else:
                with self.timer.stage("sampling"):
                    tokens = draw_rows(logits, params, uniforms)
        except Exception:  # noqa: BLE001 (each sequence then draws, and fails, alone)
            log.warning("drawing a step's tokens together failed; each draws alone"
                        " (a seeded one then spends another number)", exc_info=True)
            self._take_back_ahead()
            return {}
        return {id(s): t for s, t in zip(seqs, tokens, strict=True)}

    def _can_launch_ahead(self, plain: list[tuple[Sequence, torch.Tensor]]) -> bool:
        """Whether the next step can be queued from this one's tokens on the device: every
        running sequence draws plainly here (greedy or at temperature, with nothing but the
        filters: `_draw`) and decodes one token next (no prompt waits, no drafts, no
        pooling), and each cache has room for it."""
        return (
            self.ahead is not None
            and len(plain) == len(self.running)
            and all(s.drafts is None and s.cache.length < s.cache.capacity for s, _ in plain)
        )

    def _launch_ahead(
        self, seqs: list[Sequence], logits: torch.Tensor, params: list[SamplingParams],
        uniforms: list[float],
    ) -> list[int | None]:  # fmt: skip
        """The tokens of `seqs` (every running sequence) from their logits: drawn on the
        device (`draw_on_device`), the next step queued from them there (`ahead`), then read.
        A pool short of a block for them queues nothing (the next step plans as usual); a
        draw the device could not finish alone (a top-p cut in a flat distribution) takes the
        queued step back and draws again as `draw_rows` does, with the same uniforms."""
        assert self.ahead is not None
        n = len(seqs)
        with self.timer.stage("sampling"):
            drawn = draw_on_device(logits, params, uniforms)
            # queued before the next step, not behind it
            copied = HostCopy(torch.cat([drawn.tokens, drawn.ok.long(), drawn.redo.long()[None]]))
        try:
            self._ahead = _Ahead(seqs, self.ahead([s.cache for s in seqs], drawn.tokens))
            self.ahead_steps += 1
        except KVPoolFull:
            pass
        except Exception:  # noqa: BLE001 (a way to go faster: the steps go on without it)
            log.warning("queueing a step ahead failed; steps run one after the other from"
                        " now on (same tokens)", exc_info=True)  # fmt: skip
            self.ahead = None
        with self.timer.stage("sampling"):
            read = copied.wait().tolist()
            if read[2 * n]:  # the queued step's tokens may be wrong
                self.ahead_taken_back += self._ahead is not None
                self._take_back_ahead()
                return draw_rows(logits, params, uniforms)
        tokens = [int(t) if ok else None for t, ok in zip(read[:n], read[n : 2 * n], strict=True)]
        if self._ahead is not None:
            for s, t in zip(seqs, tokens, strict=True):
                if t is not None:  # None: it fails, and leaving gives the queued token back
                    s.cache.tokens[-1] = t  # the id the queued step computes
        return tokens

    def _take_back_ahead(self) -> None:
        """Forget a step queued ahead: each of its sequences gives back the token's KV."""
        if self._ahead is not None:
            for s in self._ahead.seqs:
                self._drop_ahead(s)
            self._ahead = None

    def _sample(
        self, s: Sequence, logits: torch.Tensor, drawn: dict[int, int | None]
    ) -> list[GenerationEvent]:
        """Sequence s's events from its logits: the token drawn with the others (`_draw`),
        else its own draw, or a verify of its drafts (several events)."""
        if id(s) in drawn:
            return [s.sample(logits[-1], Sample(drawn_token(drawn[id(s)])))]
        if s.proposed:
            drafted, accepted = s.drafted, s.accepted
            events = s.verify(logits)
            self.drafted += s.drafted - drafted
            self.accepted += s.accepted - accepted
            self.verifies += 1
            return events
        return [s.sample(logits[-1])]
