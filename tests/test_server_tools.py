"""Tools on the default model (SmolLM2-135M-Instruct, whose template ignores tools: they go
into the system prompt in the Hermes form) through the real `openai` client: forced calls
(`required`, a named function) parsed into `tool_calls`, a round trip with a `tool` message,
streamed calls, `none`, and the 400s. The daemon is the one `test_server_api` uses.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.server_helpers import Daemon, shared_daemon

MODEL = "default"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
TIMEZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description":
     "The current weather of a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description":
     "The time in a time zone", "parameters": TIMEZONE}},
]  # fmt: skip
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("default")


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return daemon.client()


def test_required_returns_a_call_that_fits_the_schema(client: openai.OpenAI) -> None:
    import jsonschema
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS[:1], tool_choice="required", temperature=1.0,
        seed=3, n=2, max_tokens=60,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1, choice
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert choice.message.content is None
    # the same with tool_choice auto: the model is free, nothing forced a call
    free = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS[:1], temperature=1.0, seed=3, max_tokens=20
    )
    assert free.choices[0].message.content != r.choices[0].message.content


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for name, schema in (("get_time", TIMEZONE), ("get_weather", WEATHER)):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": name}},
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls is not None
        (call,) = choice.message.tool_calls
        assert call.function.name == name
        args = json.loads(call.function.arguments)
        assert set(args) == set(schema["required"]), args  # type: ignore[arg-type]


def test_round_trip_with_a_tool_message(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=60,
    )  # fmt: skip
    assistant = first.choices[0].message
    assert assistant.tool_calls
    call = assistant.tool_calls[0]
    history: Any = [
        *ASK,
        assistant.model_dump(exclude_none=True) | {"content": None},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=30
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length"), choice
    assert choice.message.content and not choice.message.tool_calls, choice
    # the call and its result are in the prompt, which is longer than the question's
    asked = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=1
    )
    assert r.usage and asked.usage
    assert r.usage.prompt_tokens > asked.usage.prompt_tokens + 20


def test_streamed_call(client: openai.OpenAI) -> None:
    kw: Any = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
               "temperature": 1.0, "seed": 11, "max_tokens": 60, "logprobs": True}  # fmt: skip
    reply = client.chat.completions.create(**kw).choices[0]
    whole = reply.message.tool_calls
    assert whole and reply.logprobs and reply.logprobs.content
    calls: list[Any] = []
    tokens: list[str] = []
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
        if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            tokens += [t.token for t in chunk.choices[0].logprobs.content]
    assert finish == "tool_calls" and content == ""
    # the held text's tokens still stream their logprobs
    assert tokens == [t.token for t in reply.logprobs.content]
    assert [c.index for c in calls] == [0]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == whole[0].function.name
    assert calls[0].function.arguments == whole[0].function.arguments


def test_tool_choice_none_and_no_tools(client: openai.OpenAI) -> None:
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "auto"}):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=8, **kw
        )
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert choice.message.content


def _error(daemon: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, raw = daemon.post("/v1/chat/completions", json.dumps(body).encode())
    return status, json.loads(raw).get("error", {})


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
])  # fmt: skip
def test_tool_errors(daemon: Daemon, extra: dict[str, Any], param: str) -> None:
    status, err = _error(daemon, {"messages": ASK, "max_tokens": 1, **extra})
    assert status == 400 and err["param"] == param, err
