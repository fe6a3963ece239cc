"""Several requests at once (`server.parallel`): the generator runs every running request's
next tokens in one batched step, and each request gets exactly what it gets alone; the
scheduler's engine thread takes turns between the jobs it runs."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import openai
import pytest
import torch

from kernels.cpu.experts import CpuExperts
from stratactl.client import Client
from stratad.config import Config, EngineConfig, ServerConfig
from stratad.engine.batch import Seq
from stratad.engine.kv import KVPool
from stratad.engine.placement import start_plan
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.protocol import StatusReply, StatusRequest
from stratad.runtime.generate import Generator
from stratad.runtime.jobs import Delta, Job, JobError, PreparedJob
from stratad.runtime.prefix import PrefixStore
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.scheduler import EngineFailed, Scheduler
from stratad.runtime.sequence import GenerationRequest
from tests.server_helpers import shared_daemon, wait_until

GREEDY = SamplingParams(temperature=0.0)


class Recording:
    """The forward, with how many sequences each step carried."""

    def __init__(self, forward: ReferenceForward) -> None:
        self.forward, self.sizes, self.tokens = forward, list[int](), list[int]()

    def new_pool(self, tokens: int) -> KVPool:
        return self.forward.new_pool(tokens)

    def step(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        self.sizes.append(len(seqs))
        self.tokens.append(sum(len(s.tokens) for s in seqs))
        return self.forward.step(seqs)


@pytest.fixture(scope="module")
def model(tiny_moe_model: Model) -> Model:
    return tiny_moe_model  # the session's (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(model: Model) -> tuple[ReferenceForward, object]:
    """The cpu engine on the tiny MoE: its layers in one kernel call, a batch in one call."""
    forward = ReferenceForward(model, weights=QuantWeights(CpuExperts(threads=2)))
    assert forward.stack is not None
    return forward, tokenizer_from_gguf(model.metadata)


def _gen(engine: tuple, parallel: int) -> tuple[Generator, Recording]:
    forward, tokenizer = engine
    rec = Recording(forward)
    store = PrefixStore(1 << 30, 1 << 30)
    return Generator(rec, tokenizer, 256, prefill_chunk=32, prefix_store=store,
                     parallel=parallel), rec  # fmt: skip


def _req(n: int, start: int, max_tokens: int) -> GenerationRequest:
    prompt = list(range(start, start + n))
    return GenerationRequest(prompt, max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)


def _events(runs: list[Iterator]) -> list[list[tuple[int, str, str | None]]]:
    """Every run's events, asking each for one in turn (as the scheduler does)."""
    got: list[list[tuple[int, str, str | None]]] = [[] for _ in runs]
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            event = next(runs[i], None)
            if event is None:
                live.remove(i)
            else:
                got[i].append((event.token, event.text, event.finish_reason))
    return got


def test_requests_share_steps_and_get_what_they_get_alone(engine: tuple) -> None:
    # a long prompt (three chunks), a short one, one that ends first
    reqs = [_req(70, 100, 6), _req(7, 900, 10), _req(40, 2000, 3)]
    alone, one = _gen(engine, 1)
    want = [_events([alone.run(r)])[0] for r in reqs]
    gen, rec = _gen(engine, 3)
    got = _events([gen.run(r) for r in reqs])
    assert got == want
    assert [e[-1][2] for e in got] == ["length"] * 3
    assert max(rec.sizes) == 3 and len(rec.sizes) < len(one.sizes)
    assert gen.free == 3 and not gen.loop.running


def test_prompts_arriving_together_share_the_step_budget_with_the_decodes(engine: tuple) -> None:
    """A request decoding and two 64-token prompts (two chunks of 32 each) arriving together:
    every step computes at most one chunk beside the decodes (the default budget, 32 + 3), the
    decoding one gets a token at every step, and each gets what it gets alone."""
    reqs = [_req(5, 100, 12), _req(64, 1000, 3), _req(64, 2000, 3)]
    alone, _ = _gen(engine, 1)
    want = [_events([alone.run(r)])[0] for r in reqs]
    gen, rec = _gen(engine, 3)
    first = gen.events(gen.start(reqs[0]))
    head = next(first)  # its prompt and first token: one step
    arriving = [gen.events(gen.start(r)) for r in reqs[1:]]
    got = _events([first, *arriving])
    assert [[(head.token, head.text, head.finish_reason), *got[0]], *got[1:]] == want
    # the second prompt's two chunks, then the third's, each beside the decodes
    assert rec.tokens[:5] == [5, 1 + 32, 1 + 32, 2 + 32, 2 + 32]
    assert max(rec.tokens) <= 32 + 3 and gen.free == 3


def test_nothing_reads_a_cache_past_its_length(engine: tuple) -> None:
    """Host caches are allocated uninitialised (their pages commit as tokens reach them): with
    every buffer full of NaN first, the cpu engine's tokens (its one-call layers' attention in
    C) are those of zeroed caches."""
    forward, tokenizer = engine
    rec = Recording(forward)
    outs = []
    for fill in (0.0, float("nan")):
        gen = Generator(rec, tokenizer, 96, prefill_chunk=16, parallel=2)
        for c in gen.caches:
            for t in c.k + c.v:
                t.fill_(fill)
        outs.append(_events([gen.run(_req(20, 100, 6)), gen.run(_req(3, 700, 9))]))
    assert outs[0] == outs[1]


# a schema llguidance compiles but cannot follow: it fails on the first sampled token
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                           "required": ["next"]}}, "$ref": "#/$defs/n"}  # fmt: skip


def test_a_request_failing_mid_step_leaves_its_neighbours_tokens(engine: tuple) -> None:
    """Three requests share steps; the middle one's grammar fails when it samples (in a step
    shared with the others, after the first had sampled): it alone gets the error, and both
    neighbours get every token they get alone (before, the first lost that step's token)."""
    from stratad.server.structured import json_grammar

    reqs = [_req(9, 300, 8), _req(5, 600, 8), _req(12, 1200, 8)]
    failing = dataclasses.replace(reqs[1], grammar=json_grammar(ENDLESS, "response_format"))
    alone, _ = _gen(engine, 1)
    want = [_events([alone.run(r)])[0] for r in (reqs[0], reqs[2])]
    gen, rec = _gen(engine, 3)
    runs = [gen.run(reqs[0]), gen.run(failing), gen.run(reqs[2])]
    got: list[list[tuple[int, str, str | None]]] = [[], [], []]
    errors: list[str] = []
    live = [0, 1, 2]
    while live:
        for i in list(live):
            try:
                event = next(runs[i], None)
            except RuntimeError as err:
                errors.append(f"{i}: {err}")
                live.remove(i)
                continue
            if event is None:
                live.remove(i)
            else:
                got[i].append((event.token, event.text, event.finish_reason))
    assert len(errors) == 1 and errors[0].startswith("1: the grammar refused"), errors
    assert got[1] == [] and [got[0], got[2]] == want
    assert max(rec.sizes) >= 2 and gen.free == 3 and not gen.loop.running


def test_a_long_prompt_arriving_costs_the_running_one_a_step_per_turn(engine: tuple) -> None:
    """A request decoding, then a 200-token prompt (7 chunks of 32): taking turns, the
    decoding one gets a token at every step of the other's prefill, not all after it."""
    gen, rec = _gen(engine, 2)
    running = gen.turns(gen.start(_req(10, 100, 30)))
    assert next(running) is not None  # its prompt in one step, its first token
    arriving = gen.turns(gen.start(_req(200, 3000, 10)))
    order = []
    while len(order) < 16:
        order.append("r" if next(running) is not None else "-")
        order.append("a" if next(arriving) is not None else "-")
    # one step a round: the running one's turn steps the loop in the first round only (after
    # that its event is waiting), the arriving one's in every round; its 7th chunk, with its
    # first token, is the 7th step: round 6
    first = order.index("a")
    assert first == 2 * 6 - 1
    assert order[:first:2] == ["r"] * 6  # a token of the running one in each of those rounds
    assert order[1:first:2] == ["-"] * 5
    assert max(rec.sizes[1:]) == 2
    running.close()
    arriving.close()
    assert gen.free == 2


def test_a_conversation_keeps_its_cache(engine: tuple) -> None:
    gen, _ = _gen(engine, 2)
    first, other = _req(50, 100, 4), _req(30, 3000, 4)
    for r in (first, other):
        _events([gen.run(r)])
    _events([gen.run(first)])  # the cache that holds it, not the one taken longest ago
    assert gen.cached_tokens == 49  # all but the last prompt token, from its own cache
    assert sorted(c.tokens[0] for c in gen.caches) == [100, 3000]  # the other one kept too


def test_every_cache_in_use_is_refused_and_a_closed_run_frees_its_own(engine: tuple) -> None:
    gen, _ = _gen(engine, 1)
    run = gen.run(_req(10, 100, 50))
    next(run)
    with pytest.raises(RuntimeError, match="in use"):
        gen.start(_req(5, 400, 2))
    run.close()  # the client went away mid-answer
    assert gen.free == 1 and not gen.loop.running
    assert _events([gen.run(_req(5, 400, 2))])[0]


class Turns:
    """An engine that notes whose delta each step makes, three per job."""

    model_id, max_context = "turns", 64

    def __init__(self, parallel: int) -> None:
        self.parallel = parallel
        self.order: list[str] = []
        self.jobs: dict[object, list] = {}  # handle -> [name, deltas given]

    def prepare(self, job: Job) -> PreparedJob:
        return PreparedJob(job=job, prompt=(1,), max_tokens=3)

    def add(self, job: PreparedJob) -> object:
        if job.job.prompt == "bad":
            raise JobError("cannot start this one", "prompt")
        if job.job.prompt == "bug":
            raise RuntimeError("a bug starting this one")
        handle = object()
        self.jobs[handle] = [str(job.job.prompt), 0]
        return handle

    def step(self) -> list[tuple[object, Delta | Exception]]:
        if any(job[0] == "boom" for job in self.jobs.values()):
            self.jobs.clear()  # as the engine: a failed step takes every job off it
            raise RuntimeError("the forward failed")
        out: list[tuple[object, Delta | Exception]] = []
        for handle, job in list(self.jobs.items()):
            self.order.append(job[0])
            i = job[1]
            job[1] += 1
            out.append((handle, Delta(text=str(i), finish_reason="length" if i == 2 else None)))
            if i == 2:
                del self.jobs[handle]
        return out

    def abort(self, handle: object) -> None:
        self.jobs.pop(handle, None)


@pytest.mark.parametrize(("parallel", "order"), [(1, "AAABBB"), (2, "ABABAB")])
def test_the_engine_thread_steps_every_running_job(parallel: int, order: str) -> None:
    scheduler, engine = Scheduler(max_queue=4), Turns(parallel)
    scheduler.state = "ready"

    async def serve() -> list[str]:
        tickets = []
        for name in "AB":  # both queued before the engine thread starts
            scheduler.admit()
            tickets.append(scheduler.submit(engine.prepare(Job(prompt=name))))
        scheduler.attach(engine)
        texts = []
        for t in tickets:
            texts.append("".join([d.text async for d in t.stream()]))
        return texts

    assert asyncio.run(serve()) == ["012", "012"]
    assert "".join(engine.order) == order
    assert scheduler.num_running == 0


def _answers(names: tuple[str, ...]) -> tuple[list[str], Scheduler]:
    """Jobs `names` queued, then served by `Turns` with two places: each one's text, or the
    name of the error it got (within 10 s: a dead engine thread would never answer)."""
    scheduler, engine = Scheduler(max_queue=8), Turns(2)
    scheduler.state = "ready"

    async def serve() -> list[str]:
        tickets = []
        for name in names:
            scheduler.admit()
            tickets.append(scheduler.submit(engine.prepare(Job(prompt=name))))
        scheduler.attach(engine)
        out = []
        for t in tickets:
            try:
                out.append("".join([d.text async for d in t.stream()]))
            except (JobError, EngineFailed) as e:
                out.append(type(e).__name__)
        return out

    return asyncio.run(asyncio.wait_for(serve(), 10)), scheduler


def test_a_job_that_cannot_start_fails_alone(caplog: pytest.LogCaptureFixture) -> None:
    got, scheduler = _answers(("A", "bad", "bug", "B"))
    assert got == ["012", "JobError", "EngineFailed", "012"]
    assert scheduler.num_running == 0 and "a bug starting this one" in caplog.text


def test_a_failed_step_fails_the_jobs_it_ran_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got, scheduler = _answers(("A", "boom", "B"))  # A and boom run together; B waits
    assert got == ["EngineFailed", "EngineFailed", "012"]
    assert scheduler.num_running == 0 and "the engine failed on a step of 2" in caplog.text


def test_sixteen_clients_at_once_get_what_they_get_alone() -> None:
    """`server.parallel = 3` over HTTP: sixteen openai clients at once (the rest wait for a
    place), four of them gone mid-stream; each answer is the daemon's answer to that request
    alone, /health and `stratactl status` come back to idle, and the log has no ERROR. The
    KV pool holds one 512-token context for all three places: three long answers at once
    (7 blocks of 32 each, 16 in the pool) preempt the newest, which recompute and answer as
    they would alone."""
    daemon = shared_daemon("parallel")
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    prompts = ["Once upon a time", "The capital of France", "1, 2, 3,", "Dear sir,",
               "def fib(n):", "Roses are red", "In 1492", "The best way to",
               "Q: What is 2+2?", "Hello, my name is", "Water boils at", "Step one:"]  # fmt: skip

    def complete(prompt: str, max_tokens: int = 8) -> str:
        out = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                        temperature=0)  # fmt: skip
        return out.choices[0].text

    def long(prompt: str) -> str:
        return complete(prompt, 200)

    longs = ["1, 2, 3,", "10, 11, 12,", "100, 101, 102,"]  # counting: never an early end

    def running() -> int:
        return int(msgspec.json.decode(daemon.get("/health")[1])["running"])

    def leave(prompt: str) -> int:  # a stream its client drops after two chunks
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=200,
                                           temperature=0, stream=True)  # fmt: skip
        n = sum(1 for _, _ in zip(range(2), stream, strict=False))
        stream.close()
        return n

    with ThreadPoolExecutor(16) as pool:
        long_together = [pool.submit(long, p) for p in longs]
        wait_until(lambda: running() == 3, timeout=30, interval=0.02)  # the three together
        left = [pool.submit(leave, p) for p in ("Hello", "Why", "Tell me", "Once")]
        together = list(pool.map(complete, prompts))
    assert [f.result() for f in left] == [2] * 4
    alone = [complete(p) for p in prompts]
    assert together == alone and all(alone)
    assert [f.result() for f in long_together] == [long(p) for p in longs]
    assert "KV pool full" in daemon.log.read_text()

    def idle() -> bool:
        health = msgspec.json.decode(daemon.get("/health")[1])
        status = Client(daemon.log.parent / "stratad.sock").request(StatusRequest(), StatusReply)
        assert status.health is not None
        return (health["running"], health["waiting"]) == (0, 0) == (
            status.health.running, status.health.waiting)  # fmt: skip

    wait_until(idle, timeout=10, interval=0.05)
    assert " ERROR " not in daemon.log.read_text()


def test_the_ram_plan_counts_every_kv_cache(model: Model) -> None:
    """On a CPU host the working KV caches are host RAM: one of the whole context for each
    request served at once, counted before the expert store's RAM budget."""
    spec, cpu = model.spec, torch.device("cpu")
    config = msgspec.structs.replace(Config(), engine=EngineConfig(backend="cpu"))
    kv = {}
    for n in (1, 3):
        config = msgspec.structs.replace(config, server=ServerConfig(parallel=n))
        start = start_plan(config, model, cpu, [None], 1 << 20)
        kv[n] = dict(start.reserves)["KV caches (server.parallel)"]
    one = 2 * spec.n_layers * start.max_context * spec.kv_dim * 2  # halves
    assert kv == {1: one, 3: 3 * one}


def test_auto_parallel_is_sized_from_memory(model: Model) -> None:
    """`server.parallel = 0` (the default): up to 4 requests at once, as many whole-context KV
    caches as fit in an eighth of the host's RAM on a CPU; counted in the RAM plan too."""
    cpu = torch.device("cpu")
    config = msgspec.structs.replace(Config(), engine=EngineConfig(backend="cpu"))
    assert config.server.parallel == 0
    one = start_plan(config, model, cpu, [None], 1 << 20, host_bytes=1 << 40).parallel.kv_bytes
    counts = {}
    for host in (1 << 40, 8 * 2 * one + 1, 8 * one - 1):
        start = start_plan(config, model, cpu, [None], 1 << 20, host_bytes=host)
        counts[host] = start.parallel.count
        assert dict(start.reserves)["KV caches (server.parallel)"] == counts[host] * one
    assert list(counts.values()) == [4, 2, 1]
    assert "auto: at most 4" in start.parallel.describe()
    fixed = msgspec.structs.replace(config, server=ServerConfig(parallel=6))
    start = start_plan(fixed, model, cpu, [None], 1 << 20, host_bytes=1 << 40)
    assert start.parallel.count == 6 and "(server.parallel)" in start.parallel.describe()
    # a KV pool of two whole contexts for the six: the plan reserves two, and says why
    pooled = msgspec.structs.replace(fixed, server=ServerConfig(
        parallel=6, kv_cache_tokens=2 * start.max_context))  # fmt: skip
    start = start_plan(pooled, model, cpu, [None], 1 << 20, host_bytes=1 << 40)
    assert dict(start.reserves)["KV caches (server.parallel)"] == 2 * one
    assert start.parallel.count == 6 and "server.kv_cache_tokens" in start.parallel.describe()


def test_auto_parallel_on_a_gpu_shares_a_pool_sized_from_vram(model: Model) -> None:
    """On a GPU the offload engine serves 16 requests at once by default, sharing a KV pool of
    the whole contexts that fit in an eighth of the free VRAM (at least one, at most one
    each); the VRAM plan counts that pool. A configured `server.parallel` keeps a whole
    context per request. (A plan only: no GPU is touched.)"""
    from stratad.engine.placement import AUTO_MOST_GPU

    gpu = torch.device("cuda")
    config = msgspec.structs.replace(Config(), engine=EngineConfig(backend="offload"))
    one = start_plan(config, model, gpu, [1 << 40], 1 << 20).parallel.kv_bytes
    pools = {}
    for free in (1 << 40, 8 * 3 * one + 7, 8 * one - 1):
        p = start_plan(config, model, gpu, [free], 1 << 20).parallel
        assert p.count == AUTO_MOST_GPU == 16 and p.shared
        pools[free] = p.pool_contexts
    assert list(pools.values()) == [16.0, 3.0, 1.0]
    assert "shared by all" in p.describe() and "newest requests give their blocks back" in (
        p.describe())
    fixed = msgspec.structs.replace(config, server=ServerConfig(parallel=6))
    p = start_plan(fixed, model, gpu, [1 << 40], 1 << 20).parallel
    assert (p.count, p.pool_contexts, p.shared) == (6, 6.0, False)
    # the VRAM plan counts the pool: the expert slots get what it does not take
    free = 8 * 3 * one + 7
    config = msgspec.structs.replace(config, store=msgspec.structs.replace(
        config.store, vram_reserve_gib=0.0))  # fmt: skip (the small card's VRAM all for these)
    sixteen = msgspec.structs.replace(config, server=ServerConfig(parallel=16))
    auto, whole = (start_plan(c, model, gpu, [free], 1 << 20) for c in (config, sixteen))
    assert (auto.parallel.pool_contexts, whole.parallel.pool_contexts) == (3.0, 16.0)
    assert auto.stages[0].slots > whole.stages[0].slots > 0
    # the generator gets the pool planned: 3 contexts' tokens for the 16; a whole context
    # each (0) where the pool holds one a request; a configured size as configured
    ctx = auto.max_context
    assert auto.parallel.pool_tokens(ctx) == 3 * ctx
    assert whole.parallel.pool_tokens(ctx) == 0
    assert start_plan(config, model, gpu, [1 << 40], 1 << 20).parallel.pool_tokens(
        ctx) == 0  # fmt: skip (16 whole contexts fit: one each)
    five = msgspec.structs.replace(config, server=ServerConfig(kv_cache_tokens=5 * ctx))
    assert start_plan(five, model, gpu, [free], 1 << 20).parallel.pool_tokens(ctx) == 5 * ctx


def test_a_pool_too_small_for_all_preempts_and_every_answer_stays_its_own(engine: tuple) -> None:
    """Three requests that need 3 blocks of 32 tokens each at their ends, on a pool of 4
    blocks: the youngest give their blocks back and recompute later (their prompt and the
    tokens they had sampled, from the first of their blocks nobody took meanwhile), and each
    gets exactly the tokens it gets alone."""
    forward, tokenizer = engine
    reqs = [_req(40, 100, 40), _req(35, 900, 45), _req(38, 2000, 42)]
    alone = Generator(Recording(forward), tokenizer, 96, prefill_chunk=32)
    want = [_events([alone.run(r)])[0] for r in reqs]
    gen = Generator(Recording(forward), tokenizer, 96, prefill_chunk=32, parallel=3,
                    kv_tokens=4 * 32)  # fmt: skip
    assert gen.kv.n_blocks == 4
    got = _events([gen.run(r) for r in reqs])
    assert got == want
    assert gen.loop.preempted >= 1
    assert gen.loop.resumed_tokens > 0  # blocks still in the pool were not computed again
    assert gen.kv.free_blocks + gen.idle_blocks() == 4 and not gen.loop.running


def test_running_requests_share_the_blocks_of_a_common_prompt_start(engine: tuple) -> None:
    """A request whose prompt starts as a running one's (same scope) takes references to
    its full blocks instead of computing them, and gets what it gets alone; a request of
    another scope computes its own."""
    forward, tokenizer = engine
    system = list(range(300, 370))  # 70 tokens: two full blocks of 32
    reqs = [dataclasses.replace(_req(5, 1000 + 10 * i, 6), prompt=system + list(
        range(1000 + 10 * i, 1005 + 10 * i)), scope=scope)
        for i, scope in enumerate(("a", "a", "b"))]  # fmt: skip
    alone = Generator(Recording(forward), tokenizer, 256, prefill_chunk=32)
    want = [_events([alone.run(r)])[0] for r in reqs]
    gen = Generator(Recording(forward), tokenizer, 256, prefill_chunk=32, parallel=3)
    first = gen.events(gen.start(reqs[0]))
    head = next(first)  # its prompt is in: its full blocks are registered
    second, third = gen.start(reqs[1]), gen.start(reqs[2])
    assert (second.cached_tokens, third.cached_tokens) == (64, 0)
    assert second.cache.blocks[:2] == gen.caches[0].blocks[:2]
    assert [gen.kv.refs[b] for b in second.cache.blocks[:2]] == [2, 2]
    got = _events([first, gen.events(second), gen.events(third)])
    assert [[(head.token, head.text, head.finish_reason), *got[0]], *got[1:]] == want
