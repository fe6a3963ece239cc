"""The daemon on the default model (SmolLM2-135M-Instruct) through the real `openai` client.

HTTP answers while the model loads (/health 503 "loading", requests 503 with Retry-After),
then: chat and text completions, streamed equal to non-streamed for the same seed, usage
with `stream_options.include_usage`, a conversation's second turn reusing the first's KV.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.daemon import free_port, stop
from tests.engine_answer import greedy_chat
from tests.server_helpers import CONFIGS, Daemon, request

SEEDED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def loading_seen(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Daemon, list[Any]]]:
    """A daemon started here, and what /health and a completion said before it was ready."""
    folder = tmp_path_factory.mktemp("server-default")
    config = folder / "stratad.toml"
    config.write_text(CONFIGS["default"])
    log = folder / "stratad.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: list[tuple[str, int, bytes, str | None]] = []
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stratad", "--config", str(config), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                try:
                    status, body = request(f"{url}/health", timeout=2)
                except OSError:
                    time.sleep(0.05)
                    continue
                seen.append(("health", status, body, None))
                if status == 200:
                    break
                if len(seen) == 1:  # once, while loading: a completion is refused politely
                    import urllib.error
                    import urllib.request

                    req = urllib.request.Request(
                        f"{url}/v1/completions",
                        data=b'{"prompt": "hi"}',
                        headers={"Content-Type": "application/json"},
                    )
                    try:
                        urllib.request.urlopen(req, timeout=10)
                    except urllib.error.HTTPError as e:
                        seen.append(("completion", e.code, e.read(), e.headers["Retry-After"]))
                time.sleep(0.05)
            yield Daemon(url, log, None), seen
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def daemon(loading_seen: tuple[Daemon, list[Any]]) -> Daemon:
    return loading_seen[0]


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return daemon.client()


def test_http_answers_while_loading(loading_seen: tuple[Daemon, list[Any]]) -> None:
    _, seen = loading_seen
    first = seen[0]
    assert first[0] == "health" and first[1] == 503, seen
    assert json.loads(first[2])["status"] == "loading"
    refused = [s for s in seen if s[0] == "completion"]
    if refused:  # unless the model finished loading in between
        assert refused[0][1] == 503 and refused[0][3] and int(refused[0][3]) >= 1
    assert seen[-1][1] == 200 and json.loads(seen[-1][2])["status"] == "ok"


def test_chat_answer(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    # what the engine a CPU host serves it with computes (the cpu engine, which rounds
    # activations as llama.cpp does: "L'Étoile, la Marseillaise, ..."; the float reference
    # says "The capital of France is Paris.")
    text, finish = greedy_chat([{"role": "user", "content": "What is the capital of France?"}], 16)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, finish)


def test_chat_stream_equals_non_stream_with_usage(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Name three fruits."}]
    full = client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, **SEEDED
    )  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **SEEDED,
        )
    )  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    usage, ref = chunks[-1].usage, full.usage
    assert usage is not None and ref is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        ref.prompt_tokens,
        ref.completion_tokens,
        ref.total_tokens,
    )


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    prompt = "The three primary colours are"
    full = client.completions.create(model="default", prompt=prompt, max_tokens=10, **SEEDED)
    chunks = list(
        client.completions.create(
            model="default", prompt=prompt, max_tokens=10, stream=True, **SEEDED
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert full.usage is not None and full.usage.completion_tokens == 10


def test_second_turn_reuses_the_first(client: openai.OpenAI) -> None:
    turn1: list[Any] = [{"role": "user", "content": "Say hello."}]
    a = client.chat.completions.create(model="default", messages=turn1, max_tokens=8, temperature=0)
    reply = a.choices[0].message.content or ""
    turn2: list[Any] = [
        *turn1,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Again."},
    ]
    b = client.chat.completions.create(model="default", messages=turn2, max_tokens=4, temperature=0)
    assert a.usage is not None and b.usage is not None and b.usage.prompt_tokens_details
    assert (b.usage.prompt_tokens_details.cached_tokens or 0) >= a.usage.prompt_tokens


def test_log_has_no_errors(daemon: Daemon) -> None:
    assert daemon.log_errors() == []
    assert "Traceback" not in Path(daemon.log).read_text()
