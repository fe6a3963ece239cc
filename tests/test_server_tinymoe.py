"""The HTTP API on tiny-moe, driven with the real `openai` client over real sockets.

Streamed and non-streamed answers agree for the same seed; usage counts, prefix reuse,
the `strata_prefix` pin; bad input is a 4xx naming the field; the key, the Host guard, the
body limit; /metrics, /health, /openapi.json (equal to docs/openapi.json).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server_helpers import Daemon, shared_daemon

REPO = Path(__file__).resolve().parents[1]
SAMPLING: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("tiny")


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return daemon.client()


def _chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = _chat("Tell me about the sea.")
    full = client.chat.completions.create(model="m", messages=messages, max_tokens=24, **SAMPLING)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLING,
        )
    )  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content and text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,  # type: ignore[union-attr]
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    prompt = "Once upon a time, in a city by the river,"
    full = client.completions.create(model="m", prompt=prompt, max_tokens=20, **SAMPLING)
    chunks = list(
        client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLING,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].text and text == full.choices[0].text
    assert full.usage is not None and full.usage.completion_tokens == 20
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert full.choices[0].finish_reason == "length"


def test_completion_default_is_16_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="The history of", seed=3)
    assert r.usage is not None and r.usage.completion_tokens <= 16


def test_stop_string_cuts(client: openai.OpenAI) -> None:
    full = client.completions.create(model="m", prompt="A list:", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("no printable stop string in this output")
    cut = client.completions.create(
        model="m", prompt="A list:", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_conversation_prefix_is_reused(client: openai.OpenAI) -> None:
    first = _chat("Write a line about mountains and rivers, please.")
    a = client.chat.completions.create(model="m", messages=first, max_tokens=12, temperature=0)
    # another conversation in between: the first one is set aside, then brought back
    client.chat.completions.create(
        model="m", messages=_chat("Something else entirely."), max_tokens=4, temperature=0
    )
    reply = a.choices[0].message.content or ""
    turn2: list[Any] = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And another one?"},
    ]
    b = client.chat.completions.create(model="m", messages=turn2, max_tokens=4, temperature=0)
    assert a.usage is not None and b.usage is not None and b.usage.prompt_tokens_details
    assert (b.usage.prompt_tokens_details.cached_tokens or 0) >= a.usage.prompt_tokens


def test_cached_tokens_are_the_callers_own(client: openai.OpenAI) -> None:
    """alice's conversation is cached for alice: bob, sending the same words, finds nothing
    cached (else cached_tokens would tell him, token by token, what alice sent)."""
    secret = _chat("My account number is 4921 7781 0032 and my pin is 8812, remember it.")

    def cached(user: str) -> int:
        r = client.chat.completions.create(
            model="m", messages=secret, max_tokens=2, temperature=0, user=user
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("alice") == 0
    assert cached("bob") == 0  # the same prompt, another user: nothing of alice's is reused
    assert cached("alice") > 10  # alice's own: reused (from a snapshot: bob's came between)


def test_strata_prefix_pins_a_document(client: openai.OpenAI, daemon: Daemon) -> None:
    doc = "Reference document. " + " ".join(
        f"Fact {i}: item {i * 7} weighs {i} kg." for i in range(40)
    )
    pin = {"strata_prefix": {"messages": 1}}
    ask: list[Any] = [
        {"role": "system", "content": doc},
        {"role": "user", "content": "What is fact 3?"},
    ]
    r1 = client.chat.completions.create(
        model="m", messages=ask, max_tokens=4, temperature=0, extra_body=pin
    )  # type: ignore[arg-type]
    m = daemon.metrics()
    assert m['strata:prefix_cache_entries{kind="pinned"}'] >= 1
    ask2: list[Any] = [
        {"role": "system", "content": doc},
        {"role": "user", "content": "And fact 9?"},
    ]
    r2 = client.chat.completions.create(model="m", messages=ask2, max_tokens=4, temperature=0)
    assert r1.usage is not None and r2.usage is not None and r2.usage.prompt_tokens_details
    # all of the document (the first message) is reused; the question after it is not
    cached = r2.usage.prompt_tokens_details.cached_tokens or 0
    assert r1.usage.prompt_tokens - 16 <= cached < r2.usage.prompt_tokens - 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 9}, "stop"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3},
            "presence_penalty",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "strata_prefix": {"x": 1}},
            "strata_prefix.x",
        ),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
    ],
)
def test_bad_chat_request_names_the_field(daemon: Daemon, body: dict[str, Any], param: str) -> None:
    status, raw = daemon.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


@pytest.mark.parametrize(
    "extreme",
    [
        {"top_p": 5e-324},
        {"temperature": 5e-324},
        {"temperature": 1e-40, "top_p": 1e-300},
        {"min_p": 1.0},
        {"top_k": 1 << 20},
        {"seed": -(1 << 63)},
        {"stop": ""},
    ],
)
def test_extreme_valid_values_are_served(daemon: Daemon, extreme: dict[str, Any]) -> None:
    # found by the fuzz test: float32 underflow used to turn the distribution into NaN
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extreme}
    status, raw = daemon.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, raw


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", temperature=7)
    assert "temperature" in str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[1,2]",
        b'"text"',
        b"\xff\xfe",
        b'{"messages": null}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    ],
)
def test_malformed_bodies_are_400(daemon: Daemon, body: bytes) -> None:
    status, raw = daemon.post("/v1/chat/completions", body)
    assert status == 400 and "error" in json.loads(raw)


def test_oversized_body_is_413(daemon: Daemon) -> None:
    body = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    status, raw = daemon.post("/v1/completions", body)
    assert status == 413 and json.loads(raw)["error"]["message"]


def test_api_key_is_required(daemon: Daemon) -> None:
    with pytest.raises(openai.AuthenticationError):
        daemon.client(api_key="wrong").models.list()
    status, _ = daemon.get("/v1/models")
    assert status == 401
    assert daemon.get("/health")[0] == 200  # health and metrics need no key
    assert daemon.get("/metrics")[0] == 200


def test_host_header_allow_list(daemon: Daemon) -> None:
    assert daemon.get("/health", {"Host": "evil.example"})[0] == 403
    assert daemon.get("/health", {"Host": "strata.test:8080"})[0] == 200
    assert daemon.get("/health", {"Host": "localhost"})[0] == 200
    assert daemon.get("/health", {"Host": "[::1]:9"})[0] == 200


def test_unknown_route_and_method(daemon: Daemon) -> None:
    status, raw = daemon.get("/v1/nothing", {"Authorization": "Bearer test-key"})
    assert status == 404 and "error" in json.loads(raw)
    status, raw = daemon.get("/v1/chat/completions", {"Authorization": "Bearer test-key"})
    assert status == 405 and "error" in json.loads(raw)


def test_models_and_health(client: openai.OpenAI, daemon: Daemon) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-moe.gguf"]
    health = daemon.health()
    assert health["status"] == "ok" and health["model"] == "tiny-moe.gguf"


def test_metrics_follow_vllm_names(daemon: Daemon) -> None:
    m = daemon.metrics()
    for name in (
        "strata:num_requests_running",
        "strata:num_requests_waiting",
        "strata:prompt_tokens_total",
        "strata:generation_tokens_total",
        "strata:e2e_request_latency_seconds_count",
        "strata:time_to_first_token_seconds_count",
        "strata:request_queue_time_seconds_count",
    ):
        assert name in m, name
    assert m["strata:generation_tokens_total"] > 0
    assert m['strata:request_success_total{finished_reason="length"}'] > 0
    assert m['strata:http_requests_total{handler="/v1/chat/completions",status="400"}'] > 0


def test_openapi_served_equals_repo_copy(daemon: Daemon) -> None:
    status, served = daemon.get("/openapi.json")
    assert status == 200
    repo = (REPO / "docs" / "openapi.json").read_bytes()
    assert served == repo, "stale: python -m stratad.server.openapi docs/openapi.json"
    spec = json.loads(served)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(
        spec["paths"]
    )


def test_server_imports_no_torch() -> None:
    code = (
        "import sys, stratad.server.app, stratad.server.openapi, stratad.runtime.scheduler;"
        " sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_log_has_no_errors(daemon: Daemon) -> None:
    assert daemon.log_errors() == []
