"""The routes people script against, on the shared tiny-moe daemon over real sockets:
/tokenize and /detokenize (llama-server's and vLLM's bodies), /v1/health, /v1/models/{id}."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import openai
import pytest

from tests.server_helpers import Daemon, shared_daemon


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("tiny")


def _post(daemon: Daemon, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, raw = daemon.post(path, json.dumps(body).encode())
    return status, json.loads(raw)


def test_tokenize_round_trip_in_both_dialects(daemon: Daemon) -> None:
    text = "Hello, world! Ünïcödé and <b>markup</b>."
    status, llama = _post(daemon, "/tokenize", {"content": text})
    assert status == 200, llama
    ids = llama["tokens"]
    assert ids and all(isinstance(i, int) for i in ids) and llama["count"] == len(ids)
    assert llama["max_model_len"] > 0
    # vLLM's body: BOS as the model asks (tiny-moe's GGUF says whether), the same text after it
    status, vllm = _post(daemon, "/tokenize", {"prompt": text, "model": "tiny-moe.gguf"})
    assert status == 200 and vllm["tokens"][-len(ids) :] == ids
    status, plain = _post(daemon, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == ids
    status, back = _post(daemon, "/detokenize", {"tokens": ids})
    assert status == 200 and back == {"content": text, "prompt": text}
    status, pieces = _post(daemon, "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == ids
    # a piece is one token's bytes as text: a character split across tokens shows as U+FFFD
    ascii_text = "Hello, world! <b>markup</b>."
    status, pieces = _post(daemon, "/tokenize", {"content": ascii_text, "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == ascii_text


def test_tokenize_messages_counts_what_a_chat_request_does(daemon: Daemon) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    status, body = _post(daemon, "/tokenize", {"messages": messages})
    assert status == 200, body
    done = daemon.client().chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert done.usage is not None and done.usage.prompt_tokens == body["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"content": "a", "prompt": "b"}, None),
        ("/tokenize", {"content": "a", "nonsense": 1}, "nonsense"),
        ("/tokenize", {"content": 5}, "content"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"content": "x"}, None),
    ],
)
def test_bad_token_bodies_are_400(
    daemon: Daemon, path: str, body: dict[str, Any], param: str | None
) -> None:
    status, answer = _post(daemon, path, body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param, answer


def test_tokenizer_routes_need_the_key(daemon: Daemon) -> None:
    for path in ("/tokenize", "/detokenize"):
        status, _ = daemon.post(path, b'{"tokens": []}', {"Authorization": "Bearer wrong"})
        assert status == 401


def test_tokenizer_runs_off_the_event_loop(daemon: Daemon) -> None:
    """A prompt that takes the tokenizer a while does not hold up /health meanwhile."""
    text = "Strata serves mixtures of experts, word by word. " * 18000  # ~0.9 MB
    took: dict[str, float] = {}

    def big() -> None:
        t0 = time.monotonic()
        status, _ = daemon.post("/tokenize", json.dumps({"content": text}).encode())
        took["tokenize"] = time.monotonic() - t0
        assert status == 200

    worker = threading.Thread(target=big)
    worker.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    assert daemon.get("/health")[0] == 200
    health = time.monotonic() - t0
    worker.join()
    assert took["tokenize"] > 0.2, "too little work to tell: make the text longer"
    assert health < took["tokenize"] / 2, (health, took)


def test_v1_health_is_health_without_a_key(daemon: Daemon) -> None:
    status, body = daemon.get("/v1/health")
    assert (
        status == 200
        and json.loads(body)["status"] == json.loads(daemon.get("/health")[1])["status"]
    )


def test_model_by_id(daemon: Daemon) -> None:
    client = daemon.client()
    card = client.models.retrieve("tiny-moe.gguf")
    assert card.id == "tiny-moe.gguf" and card.owned_by == "strata"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    body = e.value.body
    assert isinstance(body, dict) and "gpt-4o" in body["message"]
    status, _ = daemon.get("/v1/models/tiny-moe.gguf")
    assert status == 401  # the key guards it as it does /v1/models
