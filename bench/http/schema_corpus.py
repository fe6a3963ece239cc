"""Hostile JSON schemas against a running daemon's structured output:
`bench.http.fuzz_api --schemas`.

Each schema of the corpus (deep, wide, recursive, cyclic, huge enums, nested quantifiers,
contradictions, refs that lead nowhere) goes to /v1/chat/completions twice: as
`response_format: {"type": "json_schema", ...}`, and as the `parameters` of a tool the
request forces (`tool_choice: "required"`). Every answer must be a 400, or a 200 whose JSON
(the content, or the call's arguments) the schema accepts; a 200 cut at `max_tokens` is
counted apart (its JSON is unfinished by the client's choice). Then a burst of the costliest
schemas, all at once. Meanwhile a thread asks /health over and over: it must answer 200 within
a second every time (a schema is compiled off the event loop, bounded in time).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jsonschema

HEALTH_LIMIT_S = 1.0


class Raw(str):
    """A schema as JSON text: nested deeper than Python's json module writes or reads."""


def _nested_objects(depth: int) -> Raw:
    return Raw(
        '{"type":"object","properties":{"a":' * depth
        + '{"type":"integer"}'
        + '},"required":["a"]}' * depth
    )


def _nested_arrays(depth: int) -> Raw:
    return Raw(
        '{"type":"array","minItems":1,"maxItems":1,"items":' * depth
        + '{"type":"integer"}'
        + "}" * depth
    )


def _wide(n: int, required: bool, closed: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
    }
    if required:
        s["required"] = [f"p{i}" for i in range(n)]
    if closed:
        s["additionalProperties"] = False
    return s


def _refs(defs: dict[str, Any], root: str) -> dict[str, Any]:
    return {"$defs": defs, "$ref": f"#/$defs/{root}"}


def _string(**kw: Any) -> dict[str, Any]:
    return {"type": "string", **kw}


LIST = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}},
    "required": ["v"],
    "additionalProperties": False,
}
TREE = {
    "type": "object",
    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}},
    "additionalProperties": False,
}
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}

CORPUS: dict[str, Callable[[], Any]] = {
    # a few that can be followed: the grammar is no mere refusal
    "small object": lambda: {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "any JSON ({})": lambda: {},
    "enum of 3": lambda: {"enum": ["red", "green", "blue"]},
    # deep
    "objects nested 8": lambda: _nested_objects(8),
    "objects nested 40": lambda: _nested_objects(40),
    "objects nested 300": lambda: _nested_objects(300),
    "objects nested 5,000": lambda: _nested_objects(5_000),
    "arrays nested 20": lambda: _nested_arrays(20),
    "arrays nested 2,000": lambda: _nested_arrays(2_000),
    "anyOf nested 1,000": lambda: Raw('{"anyOf": [' * 1000 + "{}" + "]}" * 1000),
    # wide
    "20 required properties": lambda: _wide(20, True, closed=True),
    "1,000 optional properties": lambda: _wide(1_000, False),
    "5,000 optional properties": lambda: _wide(5_000, False),
    "10,000 optional properties": lambda: _wide(10_000, False),
    "10,000 required properties": lambda: _wide(10_000, True),
    "15,000 required properties": lambda: _wide(15_000, True),
    "10,000 properties, closed": lambda: _wide(10_000, False, closed=True),
    "anyOf of 5,000 consts": lambda: {"anyOf": [{"const": f"v{i}"} for i in range(5_000)]},
    # recursive
    "recursive, required (endless)": lambda: _refs({"n": ENDLESS}, "n"),
    "recursive, optional (a list)": lambda: _refs({"n": LIST}, "n"),
    "recursive through arrays (a tree)": lambda: _refs({"t": TREE}, "t"),
    "mutual recursion, required": lambda: _refs(
        {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
        },
        "a",
    ),
    # cyclic references with nothing between them
    "cyclic a -> a": lambda: _refs({"a": {"$ref": "#/$defs/a"}}, "a"),
    "cyclic a -> b -> a": lambda: _refs(
        {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "a"
    ),
    "cyclic a -> b -> c -> a": lambda: _refs(
        {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"$ref": "#/$defs/a"}}, "a"
    ),
    "cyclic through allOf": lambda: _refs({"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "a"),
    "ref to a missing definition": lambda: {"$ref": "#/$defs/nowhere"},
    "remote ref": lambda: {"$ref": "http://127.0.0.1:9/schema.json"},
    # huge enums
    "enum of 1,000 strings": lambda: {"enum": [f"value-{i}" for i in range(1_000)]},
    "enum of 10,000 strings": lambda: {"enum": [f"value-{i}" for i in range(10_000)]},
    "enum of 100,000 strings": lambda: {"enum": [f"value-{i}" for i in range(100_000)]},
    "enum of 500 strings of 2,000 chars": lambda: {
        "enum": [f"{i}" + "x" * 2000 for i in range(500)]
    },
    "enum of 10,000 mixed values": lambda: {
        "enum": [i if i % 2 else [i, {"k": i}] for i in range(10_000)]
    },
    "const of 100,000 chars": lambda: {"const": "y" * 100_000},
    # patterns and string lengths
    "pattern ^a{1000}{1000}$": lambda: _string(pattern="^a{1000}{1000}$"),
    "pattern ^(a{100}){100}$": lambda: _string(pattern="^(a{100}){100}$"),
    "pattern ^((a|b){50}){50}$": lambda: _string(pattern="^((a|b){50}){50}$"),
    "pattern ^(a+)+$": lambda: _string(pattern="^(a+)+$"),
    "pattern (x+x+)+y": lambda: _string(pattern="(x+x+)+y"),
    "pattern ^[a-z]{100000}$": lambda: _string(pattern="^[a-z]{100000}$"),
    "pattern with a backreference": lambda: _string(pattern="^(a)\\1$"),
    "pattern that is not a regex": lambda: _string(pattern="^(((["),
    "minLength 1,000,000": lambda: _string(minLength=1_000_000),
    "minLength above maxLength": lambda: _string(minLength=10, maxLength=2),
    "format date-time": lambda: _string(format="date-time"),
    # numbers, arrays, contradictions, nonsense
    "minimum above maximum": lambda: {"type": "integer", "minimum": 10, "maximum": 1},
    "integer between 1e300 and 1e301": lambda: {
        "type": "integer",
        "minimum": 1e300,
        "maximum": 1e301,
    },
    "integer between -1e301 and -1e300": lambda: {
        "type": "integer",
        "minimum": -1e301,
        "maximum": -1e300,
    },
    "multipleOf 1e-300": lambda: {"type": "number", "multipleOf": 1e-300},
    "array of at least 100,000 items": lambda: {
        "type": "array",
        "items": {"type": "integer"},
        "minItems": 100_000,
    },
    "allOf contradicting types": lambda: {"allOf": [{"type": "string"}, {"type": "integer"}]},
    "not {}": lambda: {"not": {}},
    "type objectx": lambda: {"type": "objectx"},
    "schema false": lambda: False,
    "schema a list": lambda: [1, 2, 3],
}

# the slowest to compile, all at once after the corpus, each as response_format and as a tool
BURST = (
    "5,000 optional properties",
    "enum of 10,000 mixed values",
    "pattern ^a{1000}{1000}$",
    "recursive, required (endless)",
)


SCHEMA = "@SCHEMA@"  # where a request body's schema text goes


def _tool_parameters(schema: Any) -> Any:
    """`schema` as a function's parameters: an object whose one property `v` is the schema
    (its `$defs` lifted to the root, where its `$ref`s point); a schema that is no object
    goes as it is."""
    if not isinstance(schema, dict):
        return schema
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    params: dict[str, Any] = {
        "type": "object",
        "properties": {"v": inner},
        "required": ["v"],
        "additionalProperties": False,
    }
    if "$defs" in schema:
        params["$defs"] = schema["$defs"]
    return params


def sent_schema(schema: Any, how: str) -> str:
    """The JSON text of the schema a request sends: the corpus's, or its tool parameters."""
    if isinstance(schema, Raw):
        if how == "response_format":
            return str(schema)
        return '{"type":"object","properties":{"v":' + schema + '},"required":["v"]}'
    return json.dumps(schema if how == "response_format" else _tool_parameters(schema))


def request_body(schema: Any, how: str, max_tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": "default",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Answer in JSON."}],
    }
    if how == "response_format":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA},
        }
    else:
        fn = {"name": "f", "description": "Takes the answer.", "parameters": SCHEMA}
        body["tools"] = [{"type": "function", "function": fn}]
        body["tool_choice"] = "required"
    return json.dumps(body).replace(f'"{SCHEMA}"', sent_schema(schema, how)).encode()


@dataclass
class Answer:
    name: str
    how: str  # response_format or tool
    status: int  # 0: no HTTP answer (the connection failed)
    outcome: str  # what the answer was, as the summary counts it
    seconds: float
    detail: str = ""

    @property
    def bad(self) -> bool:
        return self.outcome not in ("400", "200 valid", "200 cut at max_tokens")


def _post(url: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _judge(checked: str, how: str, status: int, raw: bytes) -> tuple[str, str]:
    """(outcome, detail) of one answer to a request that sent the schema `checked`."""
    if status != 200:
        try:
            message = str(json.loads(raw)["error"]["message"])[:160]
        except (ValueError, KeyError, TypeError):
            message = raw[:160].decode(errors="replace")
        return str(status), message
    choice = json.loads(raw)["choices"][0]
    if how == "response_format":
        text = choice["message"].get("content") or ""
    else:
        calls = choice["message"].get("tool_calls") or []
        if choice["finish_reason"] == "length" and not calls:
            return "200 cut at max_tokens", ""
        if not calls:
            return "200 without a call", str(choice["message"].get("content"))[:160]
        text = calls[0]["function"]["arguments"]
    if choice["finish_reason"] == "length":
        return "200 cut at max_tokens", text[:80]
    try:
        value = json.loads(text)
    except ValueError:
        return "200 not JSON", text[:160]
    try:
        jsonschema.validate(value, json.loads(checked))
    except jsonschema.ValidationError as e:
        return "200 not of the schema", f"{text[:80]}: {e.message[:80]}"
    except Exception as e:  # the validator's own limits (a regex it cannot read, a cycle, depth)
        return "200 unchecked (the validator failed)", f"{text[:80]}: {type(e).__name__}"
    return "200 valid", text[:80]


def ask(url: str, name: str, how: str, max_tokens: int, timeout: float) -> Answer:
    schema = CORPUS[name]()
    body = request_body(schema, how, max_tokens)
    t0 = time.monotonic()
    try:
        status, raw = _post(url, body, timeout)
    except OSError as e:
        return Answer(name, how, 0, "no answer", time.monotonic() - t0, repr(e)[:160])
    seconds = time.monotonic() - t0
    outcome, detail = _judge(sent_schema(schema, how), how, status, raw)
    return Answer(name, how, status, outcome, seconds, detail)


@dataclass
class HealthProbe:
    """/health asked over and over from a thread of its own while the corpus runs."""

    url: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        u = urllib.parse.urlsplit(self.url)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
                if status != 200:
                    self.failures.append(f"status {status}")
            except OSError as e:
                self.failures.append(repr(e)[:120])
            self.latencies.append(time.monotonic() - t0)
            self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@dataclass
class CorpusResult:
    answers: list[Answer]
    burst: list[Answer]
    health: HealthProbe
    seconds: float
    tracebacks: int = 0  # in the daemon's log, counted by the caller

    @property
    def requests(self) -> int:
        return len(self.answers) + len(self.burst)

    @property
    def server_errors(self) -> int:
        return sum(1 for a in (*self.answers, *self.burst) if a.status >= 500)

    @property
    def health_ok(self) -> bool:
        h = self.health
        return not h.failures and bool(h.latencies) and max(h.latencies) < HEALTH_LIMIT_S

    @property
    def clean(self) -> bool:
        every = (*self.answers, *self.burst)
        clean = self.server_errors == 0 and not any(a.bad for a in every) and not self.tracebacks
        return clean and self.health_ok

    def markdown(self) -> str:
        every = [*self.answers, *self.burst]
        statuses = Counter(a.status for a in every)
        outcomes = Counter(a.outcome for a in every)
        lat = sorted(self.health.latencies)
        rows = "\n".join(
            f"| {a.name} | {a.how} | {a.outcome} | {a.seconds:.2f} | "
            f"{a.detail.replace('|', '/')[:100]} |"
            for a in every
        )
        burst_s = max((a.seconds for a in self.burst), default=0.0)
        return (
            f"- schemas: {len(CORPUS)}, each as response_format and as a forced tool's"
            f" parameters, one at a time; then a burst of {len(self.burst)} at once"
            f" ({', '.join(BURST)}; each both ways), answered within {burst_s:.1f} s\n"
            f"- requests sent: {self.requests} in {self.seconds:.0f} s"
            f" (status {', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))})\n"
            f"- outcomes: {', '.join(f'{o}: {n}' for o, n in outcomes.most_common())}\n"
            f"- 5xx answers: {self.server_errors}; answers neither 400 nor a 200 of valid JSON"
            f" (cut at max_tokens aside): {sum(a.bad for a in every)}\n"
            f"- /health: {len(lat)} probes, {len(self.health.failures)} failed; latency max"
            f" {1000 * max(lat, default=0):.0f} ms, median {1000 * lat[len(lat) // 2]:.0f} ms\n"
            f"- tracebacks in the daemon's log: {self.tracebacks}\n"
            f"\n| schema | sent as | outcome | s | detail |\n| --- | --- | --- | --- | --- |\n"
            f"{rows}\n"
        )


def run(url: str, max_tokens: int = 48, timeout: float = 300.0) -> CorpusResult:
    t0 = time.monotonic()
    with HealthProbe(url) as health:
        answers = [
            ask(url, name, how, max_tokens, timeout)
            for name in CORPUS
            for how in ("response_format", "tool")
        ]
        jobs = [(name, how) for name in BURST for how in ("response_format", "tool")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            burst = list(pool.map(lambda j: ask(url, *j, max_tokens, timeout), jobs))
    return CorpusResult(answers, burst, health, time.monotonic() - t0)
