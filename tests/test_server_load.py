"""Load: 16 concurrent streaming clients against a daemon with a queue of 8.

Every request either completes with exactly the text (and token count) of its non-streamed
reference, or is refused with 429/503 and a Retry-After; nothing is lost, duplicated or
interleaved between streams, and the daemon logs no error.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import openai
import pytest

from tests.server_helpers import Daemon, shared_daemon

CLIENTS = 16
TOKENS = 48


@dataclass
class Outcome:
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None
    finish: str | None = None
    status: int | None = None  # 429/503 if refused
    retry_after: str | None = None
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0
    texts: list[str] = field(default_factory=list)


def _request(i: int) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"Client {i}: tell me about topic {i * 17}."}],
        "max_tokens": TOKENS,
        "temperature": 0.9,
        "seed": 100 + i,
    }


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("tiny")


def test_sixteen_streaming_clients(daemon: Daemon) -> None:
    client = daemon.client()
    references = []
    for i in range(CLIENTS):
        r = client.chat.completions.create(**_request(i))
        assert r.usage is not None
        references.append((r.choices[0].message.content, r.usage.completion_tokens))
    before = daemon.metrics()
    outcomes = [Outcome() for _ in range(CLIENTS)]
    barrier = threading.Barrier(CLIENTS)

    def run(i: int) -> None:
        out = outcomes[i]
        own = daemon.client(timeout=60)  # a connection of its own, like a separate user
        barrier.wait()
        out.started = time.monotonic()
        try:
            for chunk in own.chat.completions.create(
                **_request(i), stream=True, stream_options={"include_usage": True}
            ):
                out.chunks += 1
                if chunk.usage is not None:
                    out.completion_tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    out.texts.append(chunk.choices[0].delta.content or "")
                    out.finish = chunk.choices[0].finish_reason or out.finish
        except openai.APIStatusError as e:
            out.status = e.status_code
            out.retry_after = e.response.headers.get("Retry-After")
        except Exception as e:  # reported below with the client's number
            out.error = repr(e)
        finally:
            out.ended = time.monotonic()
            own.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    wall = time.monotonic() - start
    done = [i for i, o in enumerate(outcomes) if o.status is None]
    refused = [i for i, o in enumerate(outcomes) if o.status is not None]
    assert not [(i, o.error) for i, o in enumerate(outcomes) if o.error]
    for i in done:
        o, (text, tokens) = outcomes[i], references[i]
        assert "".join(o.texts) == text, f"client {i}: stream differs from its reference"
        assert o.completion_tokens == tokens and o.finish is not None, i
    for i in refused:
        assert outcomes[i].status in (429, 503) and outcomes[i].retry_after, outcomes[i]
        assert int(outcomes[i].retry_after or 0) >= 1
    after = daemon.metrics()
    rejected = 'strata:request_rejected_total{reason="queue_full"}'
    latencies = sorted(outcomes[i].ended - outcomes[i].started for i in done)
    print(
        f"\nload: {len(done)} of {CLIENTS} streams completed, {len(refused)} refused (429),"
        f" in {wall:.2f} s; latency p50 {latencies[len(latencies) // 2]:.2f} s,"
        f" max {latencies[-1]:.2f} s;"
        f" {sum(outcomes[i].completion_tokens or 0 for i in done) / wall:.0f} tokens/s"
    )
    assert len(done) >= 9  # one running + a queue of 8 at the least
    assert len(refused) == after.get(rejected, 0) - before.get(rejected, 0)
    assert len(done) + len(refused) == CLIENTS
    assert daemon.health() | {"model": None} == {
        "status": "ok",
        "model": None,
        "running": 0,
        "waiting": 0,
    }
    assert daemon.log_errors() == []


def test_a_burst_of_large_prompts_holds_queue_places_and_health_answers(daemon: Daemon) -> None:
    """24 prompts of 300 kB at once (each too long for the context in tokens, so each is only
    tokenized): those past the queue's 8 places are refused at once, and /health answers
    promptly all along, the tokenizer letting go of the GIL while it works."""
    body = json.dumps({"prompt": "hello world, some words here! " * 10_000}).encode()
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(daemon.post("/v1/completions", body)[0]))
        for _ in range(24)
    ]
    for t in threads:
        t.start()
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert daemon.get("/health")[0] == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert set(statuses) <= {400, 429} and statuses.count(429) >= 1, statuses
    assert slowest < 0.5, f"/health took {slowest:.2f} s while prompts were tokenized"
