"""Anthropic's Messages API through the real `anthropic` client, on the default model
(SmolLM2-135M-Instruct; the daemon `test_server_api` and `test_server_tools` share): a message,
a stream (Anthropic's events, its text the message's at temperature 0), stop sequences, a
forced tool call whose `input` fits its `input_schema`, a tool result fed back,
`output_config.format`, `count_tokens`, and errors in Anthropic's shape (the key on the 'tiny'
daemon, which has one).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.server_helpers import API_KEY, Daemon, request, shared_daemon

REPO = Path(__file__).resolve().parents[1]
MODEL = "default"
# this client's `create` has no sampling arguments (Anthropic's newest models take none): the
# daemon still reads them, sent as extra fields
GREEDY: Any = {"extra_body": {"temperature": 0}}
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS: Any = [
    {"name": "get_weather", "description": "The current weather of a city",
     "input_schema": WEATHER},
    {"name": "get_time", "description": "The time in a time zone", "input_schema": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}},
]  # fmt: skip


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("default")


def _client(daemon: Daemon, **kw: Any) -> anthropic.Anthropic:
    kw.setdefault("api_key", daemon.api_key or "unused")
    return anthropic.Anthropic(base_url=daemon.url, max_retries=0, timeout=120, **kw)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> anthropic.Anthropic:
    return _client(daemon)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model=MODEL, max_tokens=12, **GREEDY, system="You are terse.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        metadata={"user_id": "u-1"},
    )  # fmt: skip
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model and m.stop_sequence is None
    assert [b.type for b in m.content] == ["text"] and _text(m).strip(), m
    assert m.stop_reason in ("end_turn", "max_tokens"), m
    assert 0 < m.usage.output_tokens <= 12
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 10


def test_a_stream_is_the_message_as_events(client: anthropic.Anthropic, daemon: Daemon) -> None:
    kw: Any = {"model": MODEL, "max_tokens": 16, **GREEDY, "messages": ASK}
    whole = client.messages.create(**kw)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    middle = [k for k in kinds[1:-2] if k != "ping"]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop", kinds
    assert set(middle[1:-1]) == {"content_block_delta"}, kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # the client's own accumulation gives the same message
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    # on the wire each frame names its event, as Anthropic's do
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": ASK, "stream": True}
    status, raw = daemon.post("/v1/messages", json.dumps(body).encode())
    assert status == 200
    frames = [f for f in raw.decode().split("\n\n") if f.strip()]
    for frame in frames:
        name = re.match(r"event: (\S+)\ndata: (.*)$", frame, flags=re.S)
        assert name is not None, frame
        assert json.loads(name[2])["type"] == name[1], frame
    assert "[DONE]" not in raw.decode()


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    kw: Any = {"model": MODEL, "max_tokens": 16, **GREEDY, "messages": ASK}
    text = _text(client.messages.create(**kw))
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    m = client.messages.create(**kw, stop_sequences=[stop, "never written"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert _text(m) == text[: text.index(stop)]


def test_a_forced_call_fits_its_schema(client: anthropic.Anthropic) -> None:
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        m = client.messages.create(
            model=MODEL, max_tokens=60, **GREEDY, messages=ASK, tools=TOOLS[:1],
            tool_choice=choice,  # type: ignore[arg-type]
        )  # fmt: skip
        assert m.stop_reason == "tool_use", m
        (call,) = m.content
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER)
    # streamed: the input arrives as input_json_delta, read back into the same object
    with client.messages.stream(
        model=MODEL, max_tokens=60, **GREEDY, messages=ASK, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:  # fmt: skip
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["input_json_delta"] and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use"
    assert final.content[0].input == call.input


def test_output_config_format_shapes_the_text(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model=MODEL, max_tokens=60, **GREEDY, messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
    )  # fmt: skip
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(_text(m)), WEATHER)


def test_a_tool_result_goes_back(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model=MODEL, max_tokens=60, **GREEDY, messages=ASK, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    call = first.content[0]
    assert call.type == "tool_use"
    history: Any = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "Sunny, 21 degrees Celsius."}]},
    ]  # fmt: skip
    m = client.messages.create(model=MODEL, max_tokens=20, **GREEDY, messages=history,
                               tools=TOOLS, tool_choice={"type": "none"})  # fmt: skip
    assert m.stop_reason in ("end_turn", "max_tokens") and _text(m), m
    assert all(b.type == "text" for b in m.content)
    # the call and its result are in the prompt
    asked = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    answered = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert answered.input_tokens > asked.input_tokens + 20


def test_count_tokens_is_the_prompt(client: anthropic.Anthropic) -> None:
    kw: Any = {"model": MODEL, "messages": ASK, "system": [{"type": "text", "text": "Be brief."}]}
    counted = client.messages.count_tokens(**kw)
    m = client.messages.create(**kw, max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    longer = [{"role": "user", "content": ASK[0]["content"] + " And in Rome?"}]
    more = client.messages.count_tokens(**{**kw, "messages": longer})
    assert more.input_tokens > counted.input_tokens


def _error(daemon: Daemon, body: dict[str, Any], path: str = "/v1/messages") -> tuple[int, Any]:
    status, raw = daemon.post(path, json.dumps(body).encode())
    return status, json.loads(raw)


@pytest.mark.parametrize(("body", "says"), [
    ({"model": MODEL, "messages": ASK}, "max_tokens is required"),
    ({"model": MODEL, "messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "image blocks are not supported"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "assistant turns"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "system": [{"text": "Be brief."}]},
     "type"),  # a system block without its type
])  # fmt: skip
def test_a_bad_request_is_answered_in_anthropics_shape(
    daemon: Daemon, body: dict[str, Any], says: str
) -> None:
    status, err = _error(daemon, body)
    assert status == 400, err
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert says in err["error"]["message"], err


def test_the_client_raises_anthropics_errors(client: anthropic.Anthropic, daemon: Daemon) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])
    # the guard's own errors are in Anthropic's shape on these paths too
    status, raw = request(f"{daemon.url}/v1/messages", b"x", {"Content-Type": "text/plain"})
    assert status == 415 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_the_key_goes_as_x_api_key() -> None:
    tiny = shared_daemon("tiny")
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(tiny, api_key="wrong").messages.create(
            model="m", max_tokens=2, messages=ASK
        )
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {  # type: ignore[comparison-overlap]
        "type": "authentication_error", "message": "missing or wrong API key"}}  # fmt: skip
    m = _client(tiny, api_key=API_KEY).messages.create(model="m", max_tokens=2, messages=ASK)
    assert m.usage.output_tokens <= 2
    # and as a bearer token, as Anthropic's `auth_token` sends it
    bearer = anthropic.Anthropic(base_url=tiny.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="m", messages=ASK).input_tokens > 0


def test_api_doc_anthropic_example_runs(daemon: Daemon) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), re.S)
    code = next(b for b in blocks if "anthropic.Anthropic" in b)
    assert '"http://127.0.0.1:8080"' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("http://127.0.0.1:8080", daemon.url), {})  # noqa: S102
    assert printed.getvalue().strip()


def test_max_tokens_past_the_context_is_cut_to_it() -> None:
    """Anthropic's clients ask for more than a small context holds (32,000 is common): the
    reply runs to the context's end and says so, where OpenAI's route answers 400."""
    fuzz = shared_daemon("fuzz")  # tiny-moe in a context of 256 tokens
    m = _client(fuzz).messages.create(model="any", max_tokens=32000, messages=ASK, **GREEDY)
    assert m.stop_reason == "model_context_window_exceeded", m
    prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert prompt + m.usage.output_tokens == 256, m.usage
