"""A client that disconnects frees the engine within one prefill chunk or one decode step.

Each test closes a real connection (the `openai` client's stream, or its timeout) while the
engine works on that request, then times how long the engine stays busy (/health's `running`
count, polled every 5 ms) and checks that the next request is served as if nothing happened.
The figures are printed (`pytest -s`) and the daemon's own measurement is on /metrics
(`strata:cancel_latency_seconds`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import openai
import pytest

from tests.server_helpers import Daemon, shared_daemon, wait_until

# the daemon notices a closed connection within its watcher's 25 ms; the engine then finishes
# the chunk or token in hand. Generous for a shared 2-core machine, far below a whole prefill.
SLACK_S = 0.35


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("tiny")


@pytest.fixture(scope="module")
def reference(daemon: Daemon) -> tuple[dict[str, Any], str]:
    """A request and its answer before any cancellation, to compare with one after."""
    req: dict[str, Any] = {
        "model": "m",
        "prompt": "The river town",
        "max_tokens": 16,
        "seed": 5,
        "temperature": 0.8,
    }
    return req, daemon.client().completions.create(**req).choices[0].text


def _long_prompt(words: int = 1150) -> str:  # about 3400 tokens
    # a fresh first word each time: no prefix of it is cached
    return uuid.uuid4().hex + " " + " ".join(f"w{i % 97}" for i in range(words))


def _busy(daemon: Daemon) -> bool:
    return int(daemon.health()["running"]) > 0


def _engine_free_after(daemon: Daemon, t0: float) -> float:
    return wait_until(lambda: not _busy(daemon), timeout=30) - t0


def _after(daemon: Daemon, reference: tuple[dict[str, Any], str]) -> None:
    req, text = reference
    assert daemon.client().completions.create(**req).choices[0].text == text
    assert daemon.health()["waiting"] == 0


def test_disconnect_mid_prefill(daemon: Daemon, reference: tuple[dict[str, Any], str]) -> None:
    client = daemon.client()
    # how long this prompt's prefill takes when nobody interrupts it
    start = time.monotonic()
    r = client.completions.create(model="m", prompt=_long_prompt(), max_tokens=1)
    full_s = time.monotonic() - start
    assert r.usage is not None and r.usage.prompt_tokens > 3000
    before = daemon.metrics()
    stream = client.completions.create(model="m", prompt=_long_prompt(), max_tokens=64, stream=True)
    wait_until(lambda: _busy(daemon), timeout=10)
    time.sleep(full_s / 4)
    assert _busy(daemon)
    t0 = time.monotonic()
    stream.close()
    latency = _engine_free_after(daemon, t0)
    after = daemon.metrics()
    key = "strata:cancel_latency_seconds_sum"
    served = after[key] - before[key]
    chunk_s = full_s * 128 / r.usage.prompt_tokens
    print(
        f"\nmid-prefill: full prefill {full_s:.2f} s (~{chunk_s * 1000:.0f} ms a 128-token"
        " chunk),"
        f" engine free {latency * 1000:.0f} ms after the disconnect"
        f" (daemon's measure {served * 1000:.0f} ms)"
    )
    # no first token: it was stopped inside the prefill
    assert (
        after["strata:time_to_first_token_seconds_count"]
        == before["strata:time_to_first_token_seconds_count"]
    )
    assert latency < 2 * chunk_s + SLACK_S and latency < full_s / 2
    _after(daemon, reference)


def test_disconnect_mid_decode(daemon: Daemon, reference: tuple[dict[str, Any], str]) -> None:
    client = daemon.client()
    stream = client.completions.create(
        model="m", prompt="Tell a very long story:", max_tokens=3000, stream=True, seed=1
    )
    received = 0
    start = time.monotonic()
    for _ in stream:
        received += 1
        if received == 30:
            break
    step_s = (time.monotonic() - start) / received
    t0 = time.monotonic()
    stream.close()
    latency = _engine_free_after(daemon, t0)
    print(
        f"\nmid-decode: ~{step_s * 1000:.0f} ms a token,"
        f" engine free {latency * 1000:.0f} ms after the disconnect"
    )
    assert latency < 2 * step_s + SLACK_S
    _after(daemon, reference)


def test_non_streaming_client_timeout_cancels(
    daemon: Daemon, reference: tuple[dict[str, Any], str]
) -> None:
    impatient = daemon.client(timeout=0.6)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="m", prompt="Count slowly:", max_tokens=3000, seed=2)
    t0 = time.monotonic()
    latency = _engine_free_after(daemon, t0)
    print(f"\nnon-streaming timeout: engine free {latency * 1000:.0f} ms after the disconnect")
    assert latency < SLACK_S + 0.1
    _after(daemon, reference)


def test_queued_request_that_disconnects_never_runs(
    daemon: Daemon, reference: tuple[dict[str, Any], str]
) -> None:
    client = daemon.client()
    before = daemon.metrics()
    # seeded: unseeded, a sampled answer to this prompt ended within 90-130 tokens in 2 of 6
    # tries, and the queued request then ran before its client gave up (seed 1 goes on past
    # 400 tokens)
    running = client.completions.create(
        model="m", prompt="First in line:", max_tokens=3000, stream=True, seed=1
    )
    next(iter(running))
    with pytest.raises(openai.APITimeoutError):  # waits behind it, then gives up
        daemon.client(timeout=0.5).completions.create(model="m", prompt="Second:", max_tokens=5)
    time.sleep(0.2)  # the daemon notices within its watcher's 25 ms
    assert daemon.health()["waiting"] == 0  # out of the queue: it never runs
    running.close()
    _engine_free_after(daemon, time.monotonic())
    after = daemon.metrics()
    aborted = 'strata:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 2
    # the queued one never reached the engine (only started requests have a queue time)
    queued = "strata:request_queue_time_seconds_count"
    assert after[queued] - before[queued] == 1
    _after(daemon, reference)


def test_log_has_no_errors(daemon: Daemon) -> None:
    assert daemon.log_errors() == []
