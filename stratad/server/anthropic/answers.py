"""Anthropic's Messages API answers: a message from a job's deltas, whole or as Anthropic's
server-sent events, with tool calls read out of the text (`stratad.server.tools.calls`).

A stream is `message_start`, `ping`, then per content block `content_block_start`, its
`content_block_delta`s (`text_delta`; a call's input whole in one `input_json_delta`) and
`content_block_stop`, then `message_delta` (the stop reason and usage) and `message_stop`; a
failure mid-stream is an `error` event. Each frame has Anthropic's `event:` line.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from stratad.runtime.jobs import Delta, JobError
from stratad.runtime.scheduler import EngineFailed, Ticket
from stratad.server.finished import CANCELLED, Unfinished, deltas_of
from stratad.server.http.sse import ClientGone, EventStream
from stratad.server.tools import calls as tool_calls
from stratad.server.tools import types as tt

# Anthropic's error types by HTTP status (`error.type`); another 4xx is invalid_request_error,
# another 5xx api_error
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class AnthropicErrorDetail(_Struct, frozen=True):
    type: str
    message: str


class AnthropicError(_Struct, frozen=True):
    """Anthropic's error body (and a stream's `error` event)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_body(status: int, message: str) -> AnthropicError:
    detail = AnthropicErrorDetail(type=error_type(status), message=message)
    return AnthropicError(type="error", error=detail)


class MessageUsage(_Struct, frozen=True):
    input_tokens: int
    """prompt tokens computed (those read from the prefix cache are `cache_read_input_tokens`)"""
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class TextContent(_Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ToolUseContent(_Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


Content = TextContent | ToolUseContent


class MessageResponse(_Struct, frozen=True):
    """A message: the reply's text and tool calls, why it stopped, and its usage."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Content]
    stop_reason: str | None
    """end_turn, max_tokens, stop_sequence, tool_use or model_context_window_exceeded"""
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(_Struct, frozen=True):
    """The prompt's tokens."""

    input_tokens: int


# --- stream events ---------------------------------------------------------------------------


class MessageStart(_Struct, frozen=True, tag="message_start", tag_field="type"):
    message: MessageResponse


class Ping(_Struct, frozen=True, tag="ping", tag_field="type"):
    pass


class ContentBlockStart(_Struct, frozen=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: Content


class TextDelta(_Struct, frozen=True, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(_Struct, frozen=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ContentBlockDelta(_Struct, frozen=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(_Struct, frozen=True, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(_Struct, frozen=True):
    stop_reason: str
    stop_sequence: str | None


class MessageDelta(_Struct, frozen=True, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: MessageUsage
    """the totals: they replace message_start's"""


class MessageStop(_Struct, frozen=True, tag="message_stop", tag_field="type"):
    pass


Event = (
    MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop
)  # fmt: skip


# --- from deltas to a message ----------------------------------------------------------------


class Header(msgspec.Struct, frozen=True):
    id: str
    model: str
    tools: bool = False  # the reply is read for tool calls


def header(model: str, tools: bool) -> Header:
    return Header(id=f"msg_{uuid.uuid4().hex}", model=model, tools=tools)


def stop_reason(ticket: Ticket, last: Delta, called: bool) -> str:
    """Anthropic's name for why the reply ended; a reply cut by the context, not by the
    client's `max_tokens`, is `model_context_window_exceeded`, as Anthropic's own says."""
    if last.finish_reason == "length":
        asked, given = ticket.prepared.job.max_tokens, ticket.prepared.max_tokens
        return "model_context_window_exceeded" if asked and given < asked else "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if last.stopping_word else "end_turn"


def usage(last: Delta) -> MessageUsage:
    return MessageUsage(
        input_tokens=last.prompt_tokens - last.cached_tokens,
        output_tokens=last.completion_tokens,
        cache_read_input_tokens=last.cached_tokens,
    )


def _tool_use(call: tt.ToolCall) -> ToolUseContent:
    return ToolUseContent(
        id=f"toolu_{uuid.uuid4().hex[:24]}",
        name=call.function.name,
        input=json.loads(call.function.arguments),
    )


def _json(status: int, body: msgspec.Struct) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body),
                        content_type="application/json")  # fmt: skip


async def collect_message(ticket: Ticket, h: Header) -> web.Response:
    """The whole message; an error in OpenAI's shape (the routes turn it into Anthropic's)."""
    try:
        deltas = await deltas_of(ticket)
    except Unfinished as e:
        return e.response
    last = deltas[-1]
    text = "".join(d.text for d in deltas)
    content, calls = tool_calls.read_reply(text) if h.tools else (text, [])
    blocks: list[Content] = [TextContent(text=content)] if content else []
    blocks += [_tool_use(c) for c in calls]
    body = MessageResponse(
        id=h.id,
        type="message",
        role="assistant",
        model=h.model,
        content=blocks,
        stop_reason=stop_reason(ticket, last, bool(calls)),
        stop_sequence=last.stopping_word or None,
        usage=usage(last),
    )
    return _json(200, body)


class _Blocks:
    """The content blocks of a streamed message: text goes into an open text block (started
    at its first text), a call into a block of its own."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.index = 0  # the next block's
        self.text_open = False

    async def send(self, event: Event) -> None:
        await self.stream.send(event, str(event.__struct_config__.tag))

    async def add(self, part: str | tt.ToolCall) -> None:
        if isinstance(part, str):
            if not part:
                return
            if not self.text_open:
                await self.send(ContentBlockStart(index=self.index,
                                                  content_block=TextContent(text="")))  # fmt: skip
                self.text_open = True
            await self.send(ContentBlockDelta(index=self.index, delta=TextDelta(text=part)))
            return
        await self.end()
        call = _tool_use(part)
        await self.send(ContentBlockStart(
            index=self.index, content_block=msgspec.structs.replace(call, input={})
        ))  # fmt: skip
        await self.send(ContentBlockDelta(
            index=self.index, delta=InputJsonDelta(partial_json=part.function.arguments)
        ))  # fmt: skip
        await self.send(ContentBlockStop(index=self.index))
        self.index += 1

    async def end(self) -> None:
        """Close the open text block, if any."""
        if self.text_open:
            await self.send(ContentBlockStop(index=self.index))
            self.index += 1
            self.text_open = False


async def stream_message(stream: EventStream, ticket: Ticket, h: Header) -> web.StreamResponse:
    blocks = _Blocks(stream)
    try:
        await stream.open()
        prompt = len(ticket.prepared.prompt)
        start = MessageResponse(
            id=h.id, type="message", role="assistant", model=h.model, content=[],
            stop_reason=None, stop_sequence=None,
            usage=MessageUsage(input_tokens=prompt, output_tokens=0),
        )  # fmt: skip
        await blocks.send(MessageStart(message=start))
        await blocks.send(Ping())
        reader = tool_calls.CallReader() if h.tools else None
        last: Delta | None = None
        try:
            async for d in ticket.stream():
                last = d
                if reader is None:
                    await blocks.add(d.text)
                    continue
                for part in reader.feed(d.text) + (reader.finish() if d.finish_reason else []):
                    await blocks.add(part)
        except (EngineFailed, JobError) as e:
            status = 400 if isinstance(e, JobError) else 500
            await stream.send(error_body(status, str(e)), "error")
            await stream.end()
            return stream.response
        if last is None or not last.finish_reason:  # cancelled by a drain, not the client
            await stream.send(error_body(503, CANCELLED), "error")
            await stream.end()
            return stream.response
        await blocks.end()
        called = reader is not None and reader.calls > 0
        stop = StopDelta(stop_reason=stop_reason(ticket, last, called),
                         stop_sequence=last.stopping_word or None)  # fmt: skip
        await blocks.send(MessageDelta(delta=stop, usage=usage(last)))
        await blocks.send(MessageStop())
        await stream.end()
    except ClientGone:
        ticket.cancel()
    return stream.response
