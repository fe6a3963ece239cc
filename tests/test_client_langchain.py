"""A third-party client beyond `openai`: LangChain's `ChatOpenAI` against the daemon on the
default model, a streamed chat and a tool call (its own tool-calling path: `bind_tools` and
the `tool_calls` it parses). The daemon is the one `test_server_api` uses."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from tests.server_helpers import Daemon, shared_daemon


@tool
def get_weather(city: str) -> str:
    """The current weather of a city."""
    return f"Sunny in {city}"


def _chat(daemon: Daemon, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{daemon.url}/v1", api_key=SecretStr(daemon.api_key or "unused"),
        model="default", max_retries=0, timeout=120, **kwargs,
    )  # fmt: skip


def test_langchain_streams_a_chat() -> None:
    daemon = shared_daemon("default")
    chat = _chat(daemon, temperature=0, max_completion_tokens=12)
    chunks = list(chat.stream([HumanMessage("What is the capital of France?")]))
    assert len(chunks) > 1 and all(isinstance(c, AIMessageChunk) for c in chunks)
    streamed = "".join(str(c.content) for c in chunks)
    whole = chat.invoke([HumanMessage("What is the capital of France?")])
    assert streamed and streamed == whole.content


def test_langchain_tool_call_round_trip() -> None:
    daemon = shared_daemon("default")
    chat = _chat(daemon, temperature=0, max_completion_tokens=60)
    ask = HumanMessage("What is the weather like in Paris?")
    forced = chat.bind_tools([get_weather], tool_choice="get_weather")
    reply = forced.invoke([ask])
    assert len(reply.tool_calls) == 1, reply
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    result = get_weather.invoke(call["args"])
    answer = chat.bind_tools([get_weather]).invoke(
        [ask, reply, ToolMessage(result, tool_call_id=call["id"])]
    )
    assert isinstance(answer.content, str)
