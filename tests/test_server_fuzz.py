"""Fuzz the HTTP API from its own OpenAPI description: no request body gets a 5xx.

Request bodies are drawn (hypothesis) from the schemas the daemon serves at /openapi.json:
valid ones, valid ones with one field replaced by arbitrary JSON, and arbitrary JSON. Every
answer must be 200, 400 or 413 with a well-formed body. The daemon (tiny-moe, 256-token
context, 8-token default completions) keeps each example short; the example count bounds
the time.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_helpers import Daemon, request, shared_daemon

EXAMPLES = 120
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# completions stay short so that valid examples cost milliseconds, not seconds
SHORT = {"max_tokens", "max_completion_tokens"}


class Schemas:
    """Hypothesis strategies from the JSON schemas of an OpenAPI document's components."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.components: dict[str, Any] = spec["components"]["schemas"]

    def of(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            return self.of(self.components[schema["$ref"].rsplit("/", 1)[1]])
        if "anyOf" in schema:
            return st.one_of([self.of(s) for s in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "const" in schema:
            return st.just(schema["const"])
        kind = schema.get("type")
        if kind == "integer":
            lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2**70)) + 1)
            hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**70) - 1)
            return st.integers(lo, hi)
        if kind == "number":
            return st.floats(
                schema.get("minimum", schema.get("exclusiveMinimum")),
                schema.get("maximum", schema.get("exclusiveMaximum")),
                exclude_min="exclusiveMinimum" in schema,
                exclude_max="exclusiveMaximum" in schema,
                allow_nan=False,
                allow_infinity=False,
            )
        if kind == "string":
            return st.text(max_size=min(schema.get("maxLength", 40), 40))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            return st.lists(
                self.of(schema.get("items", {})),
                min_size=schema.get("minItems", 0),
                max_size=min(schema.get("maxItems", 4), 4),
            )
        if kind == "object":
            props = schema.get("properties", {})
            required = set(schema.get("required", ()))
            strategies = {
                k: st.integers(1, 8) if k in SHORT else self.of(v) for k, v in props.items()
            }
            return st.fixed_dictionaries(
                {k: s for k, s in strategies.items() if k in required},
                optional={k: s for k, s in strategies.items() if k not in required},
            )
        return JSON

    def bodies(self, name: str) -> st.SearchStrategy[Any]:
        valid = self.of({"$ref": f"#/components/schemas/{name}"})
        return st.one_of(valid, valid.flatmap(_mutate), JSON)


def _mutate(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    keys = sorted(body) + ["messages", "prompt", "stream", "stop", "seed", "strata_prefix"]
    return st.tuples(st.sampled_from(keys), JSON).map(lambda kv: {**body, kv[0]: kv[1]})


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("fuzz")


@pytest.fixture(scope="module")
def schemas(daemon: Daemon) -> Schemas:
    status, raw = daemon.get("/openapi.json")
    assert status == 200
    return Schemas(json.loads(raw))


def _check(daemon: Daemon, path: str, body: Any) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode()
    status, answer = daemon.post(path, raw)
    assert status in (200, 400, 413), (status, answer[:300], raw[:300])
    if status != 200:
        assert json.loads(answer)["error"]["message"]
    elif isinstance(body, dict) and body.get("stream") is True:
        assert answer.endswith(b"data: [DONE]\n\n"), answer[-200:]
    else:
        assert json.loads(answer)["choices"]


def test_a_lone_request_with_more_choices_than_the_queue_is_served(daemon: Daemon) -> None:
    """max_queue counts requests: n = 8 choices on an idle daemon with max_queue = 4 are let
    in as one request (each choice used to take a place, so this got 429)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 2}
    status, answer = daemon.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, answer[:300]
    assert [c["index"] for c in json.loads(answer)["choices"]] == list(range(8))


@pytest.mark.parametrize(
    ("path", "schema"),
    [("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")],
)
def test_no_body_gets_a_5xx(daemon: Daemon, schemas: Schemas, path: str, schema: str) -> None:
    @FUZZ
    @given(body=schemas.bodies(schema))
    def fuzz(body: Any) -> None:
        _check(daemon, path, body)

    fuzz()


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/health",
            "/metrics",
            "/openapi.json",
            "/v1",
            "/",
        ]
    )
    | st.text(max_size=12).map(lambda s: "/" + urllib.parse.quote(s)),
)
def test_no_route_or_method_gets_a_5xx(method: str, path: str) -> None:
    url = shared_daemon("fuzz").url + path
    if method in ("GET", "POST"):
        status, _ = request(url, b"{}" if method == "POST" else None)
    else:
        req = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
    assert status < 500


def _raw(daemon: Daemon, data: bytes, hang_up: bool = False) -> bytes:
    """Send raw bytes to the daemon; its answer (nothing when we hang up first)."""
    host, port = urllib.parse.urlsplit(daemon.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        if hang_up:
            return b""
        return sock.recv(4096)


def test_hostile_bodies_get_a_4xx_or_a_quiet_close(daemon: Daemon) -> None:
    deep = b'{"prompt": "hi", "ignored": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    status, answer = daemon.post("/v1/completions", deep)
    assert status == 400 and b"nests JSON too deeply" in answer
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n")  # fmt: skip
    gz = _raw(daemon, head + b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\nhello")
    assert gz.startswith(b"HTTP/1.1 400") and b"cannot read the request body" in gz, gz
    _raw(daemon, head + b"Content-Length: 500\r\n\r\n{\"prompt\"", hang_up=True)
    for kind in ("text/plain", "application/x-www-form-urlencoded"):
        status, answer = daemon.post("/v1/completions", b'{"prompt": "hi"}',
                                     {"Content-Type": kind})  # fmt: skip
        assert status == 415 and b"must be JSON" in answer
    time.sleep(0.5)  # the hang-up reaches the daemon
    assert b"the client went away" in daemon.log.read_bytes()


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(daemon: Daemon) -> None:
    """2 MB of text cannot fit the context: refused by its byte count, before the tokenizer
    would hold the GIL over it."""
    body = json.dumps({"prompt": "word " * 400_000}).encode()
    status, answer = daemon.post("/v1/completions", body)
    assert status == 400 and b"bytes of text, more than the context" in answer, answer[:300]
    # the names of the history's tool calls count too (they escaped the count: 8 calls of
    # 3.5 MB names cost 8.6 s of tokenizer time)
    call = {"id": "c", "type": "function", "function": {"name": "f" * 500_000, "arguments": "{}"}}
    body = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": None, "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c", "content": "ok"}],
                       "max_tokens": 1}).encode()  # fmt: skip
    status, answer = daemon.post("/v1/chat/completions", body)
    assert status == 400 and b"bytes of text, more than the context" in answer, answer[:300]


def test_log_has_no_errors(daemon: Daemon) -> None:
    assert daemon.log_errors() == []
