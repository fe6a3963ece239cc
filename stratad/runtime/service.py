"""The engine as the daemon runs it: a model runner, its tokenizer and the generator behind
`Job`s: tokenising and checking requests, one step of every running job at a time, and
what each step's tokens become (deltas with text, logprobs and usage; an embedding job's one
delta carries its pooled vector)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from stratad.config import Config
from stratad.engine.runner import open_runner
from stratad.engine.timing import stages_text, tier_shares
from stratad.model.text.chat_template import writes_channels
from stratad.model.text.tokenizer_build import load_tokenizer
from stratad.runtime.generate import Generator
from stratad.runtime.grammar_check import GrammarChecker, Vocabulary
from stratad.runtime.jobs import (
    CONTEXT_LENGTH_EXCEEDED,
    Delta,
    Embed,
    Job,
    JobError,
    PreparedJob,
    TokenLogprob,
    TopLogprob,
)
from stratad.runtime.pooling import PooledEvent, PoolingRequest
from stratad.runtime.prefix import PrefixStore, common_prefix
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationEvent, GenerationRequest, Sequence
from stratad.runtime.speculation.draft_model import DraftModel, open_draft_model
from stratad.runtime.speculation.settings import Speculation
from stratad.runtime.step import Active
from stratad.runtime.template_form import template_message, template_tools
from stratad.store.tiers.pinning import ProgressFn

log = logging.getLogger("stratad.engine")


@dataclass(eq=False)
class Running:
    """A job on the engine: its sequence and the tokens it has been given."""

    job: PreparedJob
    seq: Active
    tokens: int = 0


@dataclass(frozen=True)
class EngineInfo:
    model_id: str
    arch: str
    max_context: int
    device: str


class Engine:
    """The scheduler's engine thread drives it one step at a time: `add` a prepared job when
    a place is free, `step`, `abort` a cancelled one; `prepare` only tokenises and may run
    on any thread meanwhile."""

    def __init__(self, config: Config, on_pin_progress: ProgressFn | None = None) -> None:
        self.runner = runner = open_runner(config, on_pin_progress)
        self.model, self.forward, self.store = runner.model, runner.forward, runner.store
        self.backend, self.timer = runner.backend, runner.timer
        max_context = runner.start.max_context
        self.tokenizer = load_tokenizer(self.model, config.model.chat_template_text())
        own = "the model's own" if self.tokenizer.chat_template else "ChatML (the model has none)"
        log.info("chat template: %s", config.model.chat_template or own)
        self.grammars = GrammarChecker(Vocabulary.of(self.tokenizer))  # a request's, checked
        self.last_timing: dict[str, float] = {}  # ms per decode step by stage, last request
        server = config.server
        self.prefixes = PrefixStore(
            conversation_bytes=server.conversation_cache_mib << 20,
            pinned_bytes=server.pinned_prefix_mib << 20,
        )
        # a recurrent model's state stands for its cache's tokens alone (stratad/engine/
        # recurrent.py): no cache is cut back, shares blocks or is preempted, no step runs
        # ahead; a snapshot holds a state beside its KV, reused whole; a draft is undone
        # from a copy of the state before its pass (`Sequence.checkpoint`)
        net = self.model.spec.deltanet
        recurrent = net is not None
        if net is not None:
            log.info("%s: each request's recurrent state lives in its working cache, which a"
                     " conversation's next turn continues, or in a snapshot of the prefix"
                     " store (a conversation set aside, a pinned prefix), reused whole; else a"
                     " request computes from its first token; a rejected draft takes the state"
                     " back to the step's start, the tokens that stood computed again with the"
                     " next step: no shared blocks, steps queued ahead or preemption",
                     net.describe())  # fmt: skip
        ahead = None if recurrent else runner.ahead(config.engine.step_ahead)
        if ahead is not None:
            log.info(
                "decode steps queue the next one on the GPU while every request draws with"
                " the sampling filters alone (engine.step_ahead = %s)", config.engine.step_ahead,
            )  # fmt: skip
        self.generator = Generator(
            runner,
            self.tokenizer,
            max_context,
            prefill_chunk=(
                config.engine.offload_prefill_chunk
                if self.backend == "offload"
                else server.prefill_chunk
            ),
            prefix_store=self.prefixes,
            parallel=runner.start.parallel.count,
            step_tokens=server.step_tokens,
            kv_tokens=0 if recurrent else runner.start.parallel.pool_tokens(max_context),
            prompt_rows=runner.prompt_rows,
            ahead=ahead,
            speculation=Speculation.from_config(
                config.speculation.drafter, config.speculation.max_draft,
                config.speculation.token_cost, self.backend,
                self._draft_model(config, max_context)),  # fmt: skip
            reuse=not recurrent,
        )
        kv = self.generator.kv
        if kv.host:
            # what one request at a full context reads over the link each decode step
            streamed = (max_context - kv.window) * kv.block_bytes / kv.block_size
            bw = self.store.bandwidths if self.store is not None else None
            cost = (f", about {1e3 * streamed / bw.copy_bps:.0f} ms at the measured"
                    f" {bw.copy_bps / 1e9:.1f} GB/s" if bw is not None and bw.copy_bps > 0
                    else "")  # fmt: skip
            log.info("KV: each request's newest %d tokens in VRAM, %d blocks of %d tokens there"
                     " (%.2f GiB); older blocks in page-locked RAM, %d of them (%.2f GiB), read"
                     " over PCIe by decode attention (engine.kv_resident): a request at the full"
                     " context reads %.2f GiB of it a decode step%s", kv.window, kv.n_blocks,
                     kv.block_size, kv.nbytes / 2**30, kv.n_host_blocks, kv.host_nbytes / 2**30,
                     streamed / 2**30, cost)  # fmt: skip
        spec, on = config.speculation, self.generator.speculation
        log.info("speculative decoding: %s (speculation.drafter %s)",
                 f"{type(on.drafter).__name__}, up to {spec.max_draft} tokens a step" if on
                 else "off", spec.drafter)  # fmt: skip
        self._running: dict[Active, Running] = {}
        default = ("default",) if not config.model.path else ()
        self.aliases: tuple[str, ...] = (*config.model.aliases, *default)
        self.info = EngineInfo(
            model_id=config.model.name or runner.path.name,
            arch=self.model.spec.arch,
            max_context=max_context,
            device=str(runner.device),
        )

    def _draft_model(self, config: Config, max_context: int) -> DraftModel | None:
        """`model.draft` opened for `speculation.drafter = "draft_model"` (else None)."""
        if config.speculation.drafter != "draft_model":
            return None
        return open_draft_model(config.model.draft, self.tokenizer.hf.get_vocab(),
                                self.model.spec.vocab_size, max_context, config.engine)  # fmt: skip

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @property
    def max_context(self) -> int:
        return self.info.max_context

    @property
    def model_path(self) -> str:
        """The file or folder the model was read from (llama-server's /props names it)."""
        return str(self.runner.path)

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Other names requests may give for the model (`model.aliases`)."""
        return self.aliases

    def _encode_chat(
        self, messages: list[dict[str, Any]], generation_prompt: bool, job: Job
    ) -> list[int]:
        try:
            # content is text: a control token a user types cannot close their turn
            return self.tokenizer.encode_chat(
                messages, add_generation_prompt=generation_prompt, tools=template_tools(job)
            )
        except ValueError as e:  # the template refused the conversation (e.g. role order)
            raise JobError(str(e), "messages") from None

    def tokenize(self, job: Job) -> list[int]:
        if job.messages is not None:
            return self._encode_chat([template_message(m) for m in job.messages], True, job)
        if job.prompt_ids is not None:
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in job.prompt_ids if not 0 <= t < vocab), None)
            if bad is not None:
                field = _field(job)
                raise JobError(
                    f"the {field} has token id {bad}; the vocabulary has ids 0 to {vocab - 1}",
                    field,
                )
            return list(job.prompt_ids)
        return self.tokenizer.encode(job.prompt or "", add_special=True)

    def prepare(self, job: Job) -> PreparedJob:
        """Tokenise and check a job; safe to call from any thread while `run` works.

        Raises `JobError` (naming the field) for what the client must change.
        """
        field = _field(job)
        # refused before tokenizing (which holds the GIL for seconds on megabytes of text):
        # the context's tokens cannot stand for more bytes than this
        if job.messages is None:
            text = job.prompt or ""
        else:
            text = "".join(m.content + m.reasoning
                           + "".join(c.name + c.arguments for c in m.tool_calls)
                           for m in job.messages)  # fmt: skip
            text += "".join(t.name + str(t.parameters or "") + (t.description or "")
                            for t in job.tools)  # fmt: skip
        nbytes, most = len(text.encode()), self.info.max_context * self.tokenizer.max_token_bytes
        if nbytes > most:
            raise JobError(
                f"the {field} has {nbytes:,} bytes of text, more than the context of"
                f" {self.info.max_context} tokens can hold (at most {most:,} bytes)",
                field,
                CONTEXT_LENGTH_EXCEEDED,
            )
        prompt = self.tokenize(job)
        if not prompt:
            raise JobError(f"the {field} is empty", field)
        if job.embed is not None:
            return self._prepare_embedding(job, job.embed, prompt)
        room = self.info.max_context - len(prompt)
        if room < 1:
            raise JobError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.info.max_context}"
                " (prompt and completion together)",
                field,
                CONTEXT_LENGTH_EXCEEDED,
            )
        if job.max_tokens is not None and job.max_tokens > room and not job.fit_max_tokens:
            raise JobError(
                f"max_tokens={job.max_tokens} does not fit: the context holds"
                f" {self.info.max_context} tokens and the prompt takes {len(prompt)}",
                "max_tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
        vocab = self.tokenizer.vocab_size
        for token, _ in job.logit_bias:
            if not 0 <= token < vocab:
                raise JobError(
                    f"logit_bias names token {token}; the vocabulary has ids 0 to {vocab - 1}",
                    "logit_bias",
                )
        if job.grammar is not None:
            why = self.grammars.check(job.grammar)
            if why is not None:
                raise JobError(f"{job.grammar_param} cannot be followed: {why}", job.grammar_param)
        pin = 0
        if job.prefix_messages and job.messages is not None:
            head = [template_message(m) for m in job.messages[: job.prefix_messages]]
            pin = common_prefix(self._encode_chat(head, False, job), prompt)
        elif job.prefix_tokens:
            pin = job.prefix_tokens
        return PreparedJob(
            job=job,
            prompt=tuple(prompt),
            max_tokens=room if job.max_tokens is None else min(job.max_tokens, room),
            pin=min(pin, len(prompt) - 1),
            channels=job.messages is not None and writes_channels(self.tokenizer.chat_template),
        )

    def _prepare_embedding(self, job: Job, embed: Embed, prompt: list[int]) -> PreparedJob:
        context, width = self.info.max_context, self.model.spec.hidden
        if len(prompt) > context:
            raise JobError(
                f"the input has {len(prompt)} tokens; the context holds {context}",
                "input",
                CONTEXT_LENGTH_EXCEEDED,
            )
        if embed.dimensions is not None and embed.dimensions != width:
            raise JobError(
                f"dimensions={embed.dimensions} cannot be served: this model's embeddings have"
                f" {width} dimensions, and it was not trained for shortened ones",
                "dimensions",
            )
        return PreparedJob(job=job, prompt=tuple(prompt), max_tokens=0)

    @property
    def parallel(self) -> int:
        """Requests that run at once (one working cache each)."""
        return len(self.generator.caches)

    def add(self, job: PreparedJob) -> Running:
        """Start a prepared job on a free working cache; it computes from the next `step`."""
        spec = job.job
        if spec.embed is not None:
            pooled = PoolingRequest(list(job.prompt), spec.embed.pooling, spec.scope)
            run = Running(job, self.generator.pool(pooled))
            self._running[run.seq] = run
            return run
        req = GenerationRequest(
            prompt=list(job.prompt),
            max_tokens=job.max_tokens,
            sampling=SamplingParams(
                temperature=spec.temperature,
                top_k=spec.top_k,
                top_p=spec.top_p,
                min_p=spec.min_p,
                seed=spec.seed,
                logit_bias=spec.logit_bias,
                presence_penalty=spec.presence_penalty,
                frequency_penalty=spec.frequency_penalty,
                logprobs=spec.logprobs,
            ),
            stop=spec.stop,
            ignore_eos=spec.ignore_eos,
            pin=job.pin,
            scope=spec.scope,
            grammar=spec.grammar,
        )
        run = Running(job, self.generator.start(req))
        self._running[run.seq] = run
        return run

    def step(self) -> list[tuple[Running, Delta | Exception]]:
        """One batched step of every running job: a delta for each that sampled a token (the
        last one has its finish reason), or the error that ended its own part. A job that
        ended is off the engine. Raises if the forward itself failed (every running job
        is then off the engine: its caller fails them all)."""
        try:
            outcomes = self.generator.step()
        except Exception:
            for run in list(self._running.values()):
                self.abort(run)
            raise
        out: list[tuple[Running, Delta | Exception]] = []
        for seq, outcome in outcomes:
            run = self._running[seq]
            if isinstance(outcome, Exception):
                self.abort(run)
                out.append((run, outcome))
                continue
            if isinstance(outcome, PooledEvent):
                self.abort(run)
                out.append((run, Delta(
                    text="",
                    finish_reason=outcome.finish_reason,
                    prompt_tokens=len(run.job.prompt),
                    embedding=float32_bytes(outcome.vector),
                )))  # fmt: skip
                continue
            run.tokens += 1
            if run.tokens == 1 and self.timer.enabled:  # its prefill and first sample are done
                computed = len(run.job.prompt) - seq.cached_tokens
                log.info("prefill timing: %d tokens, %s", computed,
                         stages_text(self.timer.collect()))  # fmt: skip
                self.timer.reset()  # from here on: decode steps only
            out.append((run, Delta(
                text=outcome.text,
                logprobs=self._logprobs(outcome),
                finish_reason=outcome.finish_reason,
                stopping_word=outcome.stopping_word,
                token=outcome.token,
                prompt_tokens=len(run.job.prompt),
                completion_tokens=run.tokens,
                cached_tokens=seq.cached_tokens,
            )))  # fmt: skip
            if outcome.finish_reason is not None:
                self.abort(run)
        return out

    def abort(self, run: Running) -> None:
        """Take a job off the engine (ended, failed or cancelled); its cache is free again.
        Idempotent."""
        if self._running.pop(run.seq, None) is None:
            return
        self.generator.finish(run.seq)
        if self.timer.enabled and run.tokens > 1:
            seq = run.seq
            drafts = (f"; drafts: {seq.accepted} of {seq.drafted} tokens stood"
                      if isinstance(seq, Sequence) and seq.drafted else "")  # fmt: skip
            self._log_timing(run.tokens - 1, drafts)

    def run(self, job: Job | PreparedJob) -> Iterator[Delta]:
        """One job's deltas, stepping the engine until it ends: for a caller with one request
        at a time (tests, tools), never beside the scheduler's engine thread."""
        run = self.add(job if isinstance(job, PreparedJob) else self.prepare(job))
        try:
            while run.seq in self._running:
                for r, item in self.step():
                    if r is not run:
                        continue
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            self.abort(run)

    def _logprobs(self, event: GenerationEvent) -> TokenLogprob | None:
        drawn = event.sample
        if drawn is None or drawn.logprob is None:
            return None
        if event.finish_reason == "stop" and event.token in self.tokenizer.eos_ids:
            return None  # the end of the reply, not a token of it
        tok = self.tokenizer
        return TokenLogprob(
            token=tok.token_text(drawn.token),
            bytes=tok.token_bytes(drawn.token),
            logprob=drawn.logprob,
            top=tuple(
                TopLogprob(token=tok.token_text(t), bytes=tok.token_bytes(t), logprob=lp, id=t)
                for t, lp in drawn.top
            ),
            id=drawn.token,
        )

    def _log_timing(self, tokens: int, drafts: str = "") -> None:
        """The decode's timing line: per token (a verify step settles several)."""
        per_step = {k: v / tokens for k, v in self.timer.collect().items()}
        self.last_timing = per_step
        hits = ""
        if self.store is not None:
            hits = f"; expert reads by tier: {tier_shares(self.store.stats())}"
        log.info("decode timing: %d steps, %s%s%s", tokens, stages_text(per_step, "ms/step"),
                 hits, drafts)  # fmt: skip

    def warm_up(self) -> None:
        """A short generation, so that the first request does not pay for lazy initialisation."""
        prompt = self.tokenizer.encode("Hello, world", add_special=True)
        req = GenerationRequest(
            prompt=prompt, max_tokens=8, sampling=SamplingParams(0.0), ignore_eos=True
        )
        for _ in self.generator.run(req):
            pass
        self.generator.cache.truncate(0)
        self.runner.prepare(self.generator.cache)
        if self.store is not None:  # the lookups by tier count requests' alone
            self.store.forget_lookups()

    def counters(self) -> dict[str, int]:
        """Counts for `stratactl stats`: speculative decoding's drafts, accepted tokens and
        verifying steps, and preemptions."""
        loop = self.generator.loop
        return {"drafted": loop.drafted, "accepted": loop.accepted, "verifies": loop.verifies,
                "preemptions": loop.preempted}  # fmt: skip

    def gauges(self) -> list[tuple[str, str, dict[str, str], float]]:
        """(name, help, labels, value) of the engine's own gauges, for /metrics."""
        store = self.prefixes
        timing = [
            (
                "strata:decode_stage_ms_per_step",
                "last request's decode time per step, by stage",
                {"stage": k},
                v,
            )
            for k, v in self.last_timing.items()
        ]
        held = sum(c.length for c in self.generator.caches)
        pool, loop = self.generator.kv, self.generator.loop
        kv: list[tuple[str, str, dict[str, str], float]] = [
            ("strata:kv_cache_usage_perc", "share (0-1) of the KV pool's blocks in use",
             {}, 1.0 - pool.free_blocks / max(pool.n_blocks, 1)),
            ("strata:kv_host_usage_perc", "share (0-1) of the KV pool's page-locked RAM"
             " blocks in use (engine.kv_resident; 0 without)", {},
             1.0 - pool.free_host_blocks / pool.n_host_blocks if pool.n_host_blocks else 0.0),
            ("strata:kv_cache_tokens", "tokens whose KV the working caches hold", {},
             float(held)),
            ("strata:num_preemptions_total", "requests that gave their KV blocks back to"
             " recompute later (the pool ran short)", {}, float(loop.preempted)),
            ("strata:spec_decode_num_draft_tokens_total", "tokens drafted for speculative"
             " decoding", {}, float(loop.drafted)),
            ("strata:spec_decode_num_accepted_tokens_total", "drafted tokens that stood", {},
             float(loop.accepted)),
            ("strata:spec_decode_num_verifies_total", "steps of a sequence that verified a"
             " draft", {}, float(loop.verifies)),
            ("strata:spec_decode_token_cost", "what a drafted token costs, as a share of a"
             " decode step (measured on the engine's steps, else speculation.token_cost)", {},
             loop.cost.token_cost),
        ]  # fmt: skip
        # the offload engine's misses computed on the CPU (engine.pcie_frac < 1), by stage
        stages = getattr(self.forward, "stages", [self.forward])
        cpu = [s.cpu.experts for s in stages if hasattr(s, "cpu")]
        if cpu:
            kv.append(("strata:expert_cpu_computed_total",
                       "routed experts a decode step missed in VRAM that the CPU computed from"
                       " their RAM copy", {}, float(sum(cpu))))  # fmt: skip
        return timing + kv + [
            (
                "strata:prefix_cache_bytes",
                "KV bytes held by prefix snapshots",
                {"kind": "conversation"},
                float(store.bytes_used(pinned=False)),
            ),
            (
                "strata:prefix_cache_bytes",
                "KV bytes held by prefix snapshots",
                {"kind": "pinned"},
                float(store.bytes_used(pinned=True)),
            ),
            (
                "strata:prefix_cache_entries",
                "prefix snapshots kept",
                {"kind": "conversation"},
                float(sum(not s.pinned for s in store.snapshots)),
            ),
            (
                "strata:prefix_cache_entries",
                "prefix snapshots kept",
                {"kind": "pinned"},
                float(sum(s.pinned for s in store.snapshots)),
            ),
        ]


def _field(job: Job) -> str:
    """The request field a job's prompt came from, named when it is refused."""
    if job.embed is not None:
        return "input"
    return "messages" if job.messages is not None else "prompt"


def float32_bytes(vector: torch.Tensor) -> bytes:
    """A vector as float32 little-endian bytes (OpenAI's base64 embeddings carry these)."""
    return vector.detach().float().cpu().numpy().astype("<f4").tobytes()
