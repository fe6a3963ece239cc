"""The routes people script against, on the shared tiny-moe daemon over real sockets:
/tokenize and /detokenize (llama-server's and vLLM's bodies), /v1/health, /v1/models/{id}."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

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
        ("/detokenize", {"content": "x"}, "content"),
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


def _families(daemon: Daemon) -> dict[str, Any]:
    status, raw = daemon.get("/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(raw.decode())}


def _sum(family: Any, sample: str | None = None) -> float:
    return sum(s.value for s in family.samples if sample is None or s.name == sample)


def test_metrics_parse_and_the_expert_families_move(daemon: Daemon) -> None:
    before = _families(daemon)
    daemon.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count the experts."}], max_tokens=6
    )
    after = _families(daemon)
    model = {"model_name": "tiny-moe.gguf"}
    # vLLM's names, with the model as a label
    for name in ("strata:num_requests_running", "strata:num_requests_waiting",
                 "strata:prompt_tokens", "strata:generation_tokens",
                 "strata:time_to_first_token_seconds", "strata:e2e_request_latency_seconds"):
        assert all(s.labels.items() >= model.items() for s in after[name].samples), name
    ttft = "strata:time_to_first_token_seconds_count"
    assert _sum(after["strata:time_to_first_token_seconds"], ttft) == 1 + _sum(
        before["strata:time_to_first_token_seconds"], ttft
    )
    # the expert store, read from the store itself: lookups by tier move with a request
    lookups = {s.labels["tier"]: s.value for s in after["strata:expert_lookups"].samples}
    assert set(lookups) == {"vram", "ram", "file"}
    assert sum(lookups.values()) > _sum(before["strata:expert_lookups"])
    experts = {s.labels["tier"]: s.value for s in after["strata:expert_coverage_experts"].samples}
    assert sum(experts.values()) > 0 and set(experts) == {"vram", "ram", "file_only"}
    mass = _sum(after["strata:expert_coverage_routed_mass"])
    assert 0 <= mass <= 1
    assert _sum(after["strata:expert_coverage_complete"]) == (experts["file_only"] == 0)
    (plan,) = after["strata:expert_plan_info"].samples  # an info metric: a gauge at 1
    assert plan.value == 1 and len(plan.labels["plan_hash"]) >= 8
    assert _sum(after["strata:expert_file_reads"]) >= 0
    assert 0 <= _sum(after["strata:expert_pinned_bytes"]) <= _sum(
        after["strata:expert_pin_target_bytes"]
    )
    assert _sum(after["strata:expert_slot_moves"]) >= 0  # a CPU engine has no VRAM slots
    assert 0 < _sum(after["strata:kv_cache_usage_perc"]) <= 1
    assert _sum(after["strata:kv_host_usage_perc"]) == 0  # no resident window on a CPU
    # the process collectors
    assert _sum(after["process_resident_memory_bytes"]) > 0


def test_whole_number_floats_are_integers_as_json_schema_says(daemon: Daemon) -> None:
    """`3.0` is an integer to JSON Schema (the OpenAPI document's language): token ids and
    integer fields given so are taken; a fraction is still refused, naming the field."""
    status, ids = _post(daemon, "/tokenize", {"content": "Hello"})
    status, back = _post(daemon, "/detokenize", {"tokens": [float(i) for i in ids["tokens"]]})
    assert status == 200 and back["content"] == "Hello", back
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.0, "n": 1.0}
    status, answer = _post(daemon, "/v1/chat/completions", body)
    assert status == 200, answer
    status, answer = _post(daemon, "/v1/chat/completions", {**body, "n": 1.5})
    assert status == 400 and answer["error"]["param"] == "n", answer
