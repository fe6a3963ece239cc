"""The server's parts in-process: chunked prefill and its cancellation, the prefix store,
pinned prefixes, the metrics text and its hook, the Host guard."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.jobs import Job, PreparedJob
from stratad.runtime.prefix import PrefixStore, common_prefix
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.scheduler import QueueFull, Scheduler, Unavailable
from stratad.runtime.sequence import GenerationRequest
from stratad.server.app import host_allowed
from stratad.server.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def parts(tiny_moe_model: Model) -> tuple[ReferenceForward, object]:
    model = tiny_moe_model
    return ReferenceForward(model), tokenizer_from_gguf(model.metadata)


def _gen(
    parts: tuple, chunk: int = 32, conv_bytes: int = 1 << 30, pin_bytes: int = 1 << 30
) -> Generator:
    forward, tokenizer = parts
    return Generator(
        forward,
        tokenizer,
        512,
        prefill_chunk=chunk,
        prefix_store=PrefixStore(conv_bytes, pin_bytes),
    )


def _text(gen: Generator, req: GenerationRequest) -> str:
    return "".join(e.text for e in gen.run(req))


def _prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 37) % 5000 for i in range(n)]


def test_chunked_prefill_matches_one_shot(parts: tuple) -> None:
    prompt = _prompt(150)
    one = _gen(parts, chunk=1000)
    chunked = _gen(parts, chunk=32)
    req = GenerationRequest(prompt, max_tokens=12, sampling=GREEDY, ignore_eos=True)
    assert _text(one, req) == _text(chunked, req)
    for i in range(len(one.cache.k)):
        n = len(prompt)
        torch.testing.assert_close(one.cache.k[i][:n], chunked.cache.k[i][:n], rtol=1e-4, atol=1e-4)


def test_cancel_mid_prefill_stops_within_one_chunk(parts: tuple) -> None:
    gen = _gen(parts, chunk=32)
    polls = 0

    def cancelled() -> bool:
        nonlocal polls
        polls += 1
        return polls > 2  # two chunks computed, then the client is gone

    events = list(gen.run(GenerationRequest(_prompt(200), max_tokens=5), cancelled))
    assert events == [] and gen.cache.length == 64


def test_cancel_mid_decode_stops_within_one_token(parts: tuple) -> None:
    gen = _gen(parts)
    seen: list[str] = []
    req = GenerationRequest(_prompt(20), max_tokens=100, sampling=GREEDY, ignore_eos=True)
    for event in gen.run(req, lambda: len(seen) >= 5):
        seen.append(event.text)
    assert len(seen) == 5 and gen.cache.length == 20 + 4


def test_conversation_is_set_aside_and_restored(parts: tuple) -> None:
    gen = _gen(parts)
    a, b = _prompt(80, 100), _prompt(60, 2000)
    req = GenerationRequest(a, max_tokens=6, sampling=GREEDY, ignore_eos=True)
    first = _text(gen, req)
    _text(gen, GenerationRequest(b, max_tokens=3, sampling=GREEDY))
    assert [len(s.tokens) for s in gen.store.snapshots] == [80 + 5]
    again = _text(gen, req)
    assert gen.cached_tokens == 79 and again == first


def test_prefixes_are_reused_only_within_their_scope(parts: tuple) -> None:
    gen = _gen(parts)
    prompt = _prompt(80, 100)

    def cached(scope: str, pin: int = 0) -> int:
        req = GenerationRequest(prompt, max_tokens=2, sampling=GREEDY, pin=pin, scope=scope)
        _text(gen, req)
        return gen.cached_tokens

    assert cached("alice", pin=40) == 0  # a pinned prefix of alice's, and her conversation
    assert cached("bob") == 0  # neither the live cache nor alice's snapshots serve bob
    assert cached("alice") == 79  # alice's conversation comes back from its snapshot
    assert {s.scope for s in gen.store.snapshots} == {"alice", "bob"}


def test_pinned_prefix_survives_conversation_eviction(parts: tuple) -> None:
    per_token = 2 * sum(k[0].nbytes for k in parts[0].new_cache(1).k)
    gen = _gen(parts, conv_bytes=100 * per_token)  # room for one short conversation
    doc = _prompt(70, 300)
    _text(gen, GenerationRequest([*doc, 1, 2, 3], max_tokens=2, sampling=GREEDY, pin=70))
    pinned = [s for s in gen.store.snapshots if s.pinned]
    assert [len(s.tokens) for s in pinned] == [70]
    for start in (1000, 2000, 3000):  # other conversations come and go
        _text(gen, GenerationRequest(_prompt(90, start), max_tokens=2, sampling=GREEDY))
    assert gen.store.bytes_used(pinned=False) <= 100 * per_token
    _text(gen, GenerationRequest([*doc, 9, 9], max_tokens=2, sampling=GREEDY))
    assert gen.cached_tokens == 70


def test_store_budget_and_covering(parts: tuple) -> None:
    forward = parts[0]
    cache = forward.new_cache(64)
    per_token = 2 * sum(k[0].nbytes for k in cache.k)
    store = PrefixStore(40 * per_token, 0)
    forward(_prompt(30), cache)
    assert store.save(cache, 20) and store.save(cache, 30)  # the longer covers the shorter
    assert [len(s.tokens) for s in store.snapshots] == [30]
    cache.truncate(0)
    forward(_prompt(30, 900), cache)
    store.save(cache, 30)  # over budget: the least recently used goes
    assert [s.tokens[0] for s in store.snapshots] == [900]
    assert not store.save(cache, 10)  # too short to be worth keeping
    assert common_prefix([1, 2, 3], (1, 2, 4)) == 2 and common_prefix((), [1]) == 0


def test_metrics_text_and_hook() -> None:
    m = ServerMetrics()
    m.serve("tiny")
    m.bind_scheduler(running=lambda: 1, waiting=lambda: 3)
    m.prompt_tokens.inc(5)
    m.e2e.observe(0.3)
    m.request_success.inc(finished_reason="stop")
    m.http_requests.inc(handler="/health", status="200")
    m.add_collector(
        lambda: [
            ("strata:kv_cache_usage_perc", "KV use", {}, 0.25),
            ("strata:expert_cpu_computed_total", "CPU experts", {}, 7.0),
            ("strata:decode_stage_ms_per_step", "by stage", {"stage": 'ex"perts'}, 1.5),
        ]
    )
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    tiny = {"model_name": "tiny"}

    def value(family: str, sample: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples
                    if s.name == sample and s.labels == tiny | labels)  # fmt: skip

    assert families["strata:prompt_tokens"].type == "counter"
    assert value("strata:prompt_tokens", "strata:prompt_tokens_total") == 5
    hist = "strata:e2e_request_latency_seconds"
    assert value(hist, f"{hist}_bucket", le="0.25") == 0
    assert value(hist, f"{hist}_bucket", le="0.5") == 1
    assert value(hist, f"{hist}_bucket", le="+Inf") == 1
    ttft = "strata:time_to_first_token_seconds"
    assert value(ttft, f"{ttft}_count") == 0  # there before its first observation
    assert value("strata:num_requests_waiting", "strata:num_requests_waiting") == 3
    assert value("strata:request_success", "strata:request_success_total",
                 finished_reason="stop") == 1  # fmt: skip
    http = families["strata:http_requests"].samples[0]
    assert http.labels == {"handler": "/health", "status": "200"} and http.value == 1
    assert value("strata:kv_cache_usage_perc", "strata:kv_cache_usage_perc") == 0.25
    assert families["strata:expert_cpu_computed"].type == "counter"
    assert value("strata:decode_stage_ms_per_step", "strata:decode_stage_ms_per_step",
                 stage='ex"perts') == 1.5  # fmt: skip
    assert "process_resident_memory_bytes" in families or "python_info" in families


@pytest.mark.parametrize(
    ("host", "allowed", "ok"),
    [
        ("127.0.0.1:8080", (), True),
        ("[::1]:8080", (), True),
        ("10.1.2.3", (), True),
        ("localhost:8080", (), True),
        ("LOCALHOST.", (), True),
        ("attacker.example", (), False),
        ("attacker.example:8080", (), False),
        ("box.lan:8080", ("box.lan",), True),
        ("a.box.lan", (".box.lan",), True),
        ("box.lan.evil", (".box.lan",), False),
        ("anything", ("*",), True),
        (None, (), True),
    ],
)
def test_host_allowed(host: str | None, allowed: tuple[str, ...], ok: bool) -> None:
    assert host_allowed(host, allowed) is ok


def test_requests_waiting_for_the_tokenizer_hold_queue_places() -> None:
    scheduler = Scheduler(max_queue=2)
    scheduler.state = "ready"
    job = PreparedJob(job=Job(prompt="x"), prompt=(1,), max_tokens=1)
    for _ in range(3):  # two waiting and one that the engine would run: all tokenizing
        scheduler.admit()
    assert scheduler.waiting == 3 and scheduler.in_flight == 3
    with pytest.raises(QueueFull):
        scheduler.admit()
    scheduler.withdraw()  # one turned out bad: its place is free again
    scheduler.admit()

    async def submit() -> None:
        scheduler.submit(job)

    asyncio.run(submit())  # tokenized: from the tokenizer's queue to the engine's
    assert scheduler.waiting == 3
    scheduler.begin_drain("test")
    with pytest.raises(Unavailable):
        asyncio.run(submit())
    assert scheduler.waiting == 2  # refused at submit: its place given back


def test_hold_reports_and_refuses() -> None:
    scheduler = Scheduler(max_queue=4)
    job = PreparedJob(job=Job(prompt="x"), prompt=(1,), max_tokens=1)

    async def submit() -> None:
        scheduler.admit()
        scheduler.submit(job)

    with pytest.raises(Unavailable, match="loading"):
        asyncio.run(submit())
    scheduler.state, scheduler.held = "ready", "pinning"  # loaded, the store still pinning
    assert not scheduler.ready and scheduler.status == "pinning"
    with pytest.raises(Unavailable, match="pinning"):
        asyncio.run(submit())


def test_health_says_pinning_while_the_model_loads() -> None:
    """With `store.ready_after_pinning` the store pins while the model loads: /health said
    `loading` all along; it says `pinning` while the operations report pinning."""
    from stratad.runtime.health import health_of

    scheduler = Scheduler(max_queue=4)
    assert health_of(scheduler, None).status == "loading"
    assert health_of(scheduler, None, pinning=True).status == "pinning"
    scheduler.state = "ready"
    assert health_of(scheduler, None, pinning=True).status == "ok"  # loaded: it serves
