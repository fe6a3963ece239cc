"""The answer of a completion request from its tickets: every choice collected into one
response, or streamed as server-sent events choice after choice, with usage summed over the
choices and tool calls (and, from a harmony reply, its reasoning) parsed out of the text.
`stratad.server.completions` serves the routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
from aiohttp import web

from stratad.runtime.jobs import Delta, JobError, TokenLogprob
from stratad.runtime.scheduler import EngineFailed, Ticket
from stratad.server import harmony
from stratad.server.finished import CANCELLED, Unfinished, deltas_of
from stratad.server.http.sse import ClientGone, EventStream
from stratad.server.llama.timings import Timings, timings_of
from stratad.server.openai import responses as rs
from stratad.server.tools import calls as tool_calls
from stratad.server.tools import types as tt


class Header(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    n: int = 1  # choices per prompt
    tools: bool = False  # the replies are read for tool calls
    timings: bool = False  # llama-server's `timings` on the answer and each chunk


class Reader(Protocol):
    """A reply read as it streams (`tool_calls.CallReader`, `harmony.ChannelReader`)."""

    calls: int

    def feed(self, text: str) -> Sequence[harmony.Part]: ...

    def finish(self) -> Sequence[harmony.Part]: ...


def _reader(ticket: Ticket, h: Header) -> Reader | None:
    """How a chat choice's reply is read: by channels (a harmony template), for calls (tools
    offered), or passed on as it comes (None)."""
    if ticket.prepared.channels:
        return harmony.ChannelReader(h.tools)
    return tool_calls.CallReader() if h.tools else None


def _message(ticket: Ticket, text: str, h: Header) -> rs.AssistantMessage:
    if ticket.prepared.channels:
        return harmony.channel_message(text, h.tools)
    return tool_calls.reply_message(text, h.tools)


class _Choice:
    """What one choice's ticket gave: its text, logprobs and final delta."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.last: Delta | None = None

    def add(self, d: Delta) -> None:
        self.parts.append(d.text)
        if d.logprobs is not None:
            self.logprobs.append(d.logprobs)
        self.last = d


def _usage_of(lasts: list[Delta], n: int) -> rs.Usage:
    """Summed over the choices; a prompt that its `n` choices share counts once."""
    firsts = lasts[::n]
    return rs.usage(
        sum(d.prompt_tokens for d in firsts),
        sum(d.completion_tokens for d in lasts),
        sum(d.cached_tokens for d in firsts),
    )


async def collect_answer(tickets: list[Ticket], h: Header, chat: bool) -> web.Response:
    choices: list[_Choice] = []
    try:
        for ticket in tickets:
            choices.append(c := _Choice())
            for d in await deltas_of(ticket):
                c.add(d)
    except Unfinished as e:
        return e.response
    lasts = [c.last for c in choices if c.last is not None]
    asked = tickets[0].prepared.job.logprobs is not None
    usage = _usage_of(lasts, h.n)
    timings = timings_of(list(zip(tickets, lasts, strict=True))) if h.timings else None
    body: msgspec.Struct
    if chat:
        body = rs.ChatCompletion(
            id=h.id,
            object="chat.completion",
            created=h.created,
            model=h.model,
            choices=[
                rs.ChatChoice(
                    index=i,
                    message=(m := _message(ticket, "".join(c.parts), h)),
                    finish_reason=tool_calls.finish_reason(last.finish_reason, bool(m.tool_calls)),
                    logprobs=rs.chat_logprobs(c.logprobs) if asked else None,
                )
                for i, (c, last, ticket) in enumerate(zip(choices, lasts, tickets, strict=True))
            ],
            usage=usage,
            timings=timings,
        )
    else:
        body = rs.Completion(
            id=h.id,
            object="text_completion",
            created=h.created,
            model=h.model,
            choices=[
                rs.CompletionChoice(
                    index=i,
                    text="".join(c.parts),
                    finish_reason=last.finish_reason,
                    logprobs=rs.completion_logprobs(c.logprobs) if asked else None,
                )
                for i, (c, last) in enumerate(zip(choices, lasts, strict=True))
            ],
            usage=usage,
            timings=timings,
        )
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def _chunk(
    h: Header,
    chat: bool,
    text: str | None,
    finish: str | None,
    role: bool = False,
    logprobs: TokenLogprob | None = None,
    offset: int = 0,
    index: int = 0,
    calls: list[tt.ToolCallDelta] | None = None,
    timings: Timings | None = None,
    reasoning: str | None = None,
) -> msgspec.Struct:
    """One streamed event; `offset`: where `logprobs`' token starts in the completion text."""
    if chat:
        delta = rs.ChunkDelta(role="assistant" if role else None, content=text, tool_calls=calls,
                              reasoning_content=reasoning)  # fmt: skip
        lp = rs.chat_logprobs([logprobs]) if logprobs is not None else None
        return rs.ChatCompletionChunk(
            id=h.id,
            object="chat.completion.chunk",
            created=h.created,
            model=h.model,
            choices=[rs.ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)],
            timings=timings,
        )
    clp = rs.completion_logprobs([logprobs], offset) if logprobs is not None else None
    return rs.Completion(
        id=h.id,
        object="text_completion",
        created=h.created,
        model=h.model,
        choices=[
            rs.CompletionChoice(
                index=index, text=text or "", finish_reason=finish, logprobs=clp
            )
        ],
        timings=timings,
    )


async def stream_answer(
    stream: EventStream, tickets: list[Ticket], h: Header, chat: bool, include_usage: bool
) -> web.StreamResponse:
    """The choices' events, one choice after the other (their sequences run in turn)."""
    lasts: list[Delta] = []
    try:
        await stream.open()
        for i, ticket in enumerate(tickets):
            if not await _stream_choice(stream, ticket, h, chat, i, lasts):
                for rest in tickets[i + 1 :]:
                    rest.cancel()
                break
        if include_usage and len(lasts) == len(tickets):
            usage = _usage_of(lasts, h.n)
            await stream.send(
                rs.ChatCompletionChunk(
                    id=h.id,
                    object="chat.completion.chunk",
                    created=h.created,
                    model=h.model,
                    choices=[],
                    usage=usage,
                )
                if chat
                else rs.Completion(
                    id=h.id,
                    object="text_completion",
                    created=h.created,
                    model=h.model,
                    choices=[],
                    usage=usage,
                )
            )
        await stream.done()
    except ClientGone:
        for t in tickets:
            t.cancel()
    return stream.response


async def _stream_choice(
    stream: EventStream, ticket: Ticket, h: Header, chat: bool, index: int, lasts: list[Delta]
) -> bool:
    """Stream one choice; its final delta goes to `lasts`. False if it failed or was cut."""
    if chat:
        await stream.send(_chunk(h, chat, "", None, role=True, index=index))
    last: Delta | None = None
    offset = 0
    reader = _reader(ticket, h) if chat else None
    try:
        async for d in ticket.stream():
            last = d
            timings = timings_of([(ticket, d)]) if h.timings else None
            if reader is not None:
                await _send_read(stream, reader, d, h, index, timings)
            elif d.text or d.logprobs:
                await stream.send(_chunk(h, chat, d.text, None, logprobs=d.logprobs,
                                         offset=offset, index=index, timings=timings))  # fmt: skip
                offset += len(d.logprobs.token) if d.logprobs else 0
            if d.finish_reason:
                called = reader is not None and reader.calls > 0
                finish = tool_calls.finish_reason(d.finish_reason, called)
                await stream.send(_chunk(h, chat, None if chat else "", finish, index=index,
                                         timings=timings))  # fmt: skip
    except (EngineFailed, JobError) as e:
        await stream.send(msgspec.json.decode(rs.error_body(str(e), "server_error", None)))
        return False
    if last is None or not last.finish_reason:  # cancelled by a drain, not the client
        await stream.send(
            msgspec.json.decode(
                rs.error_body(
                    CANCELLED,
                    "server_error",
                    None,
                )
            )
        )
        return False
    lasts.append(last)
    return True


async def _send_read(
    stream: EventStream,
    reader: Reader,
    d: Delta,
    h: Header,
    index: int,
    timings: Timings | None = None,
) -> None:
    """A delta of a reply read for tool calls or channels, in order: its text once known not
    to be a call or a header, its reasoning, each call made; the token's logprobs, if asked,
    with the first chunk (alone if the text is held)."""
    k = reader.calls  # the index of the next call
    parts = [*reader.feed(d.text), *(reader.finish() if d.finish_reason else ())]
    logprobs = d.logprobs
    for part in parts:
        if isinstance(part, str):
            await stream.send(
                _chunk(h, True, part, None, logprobs=logprobs, index=index, timings=timings)
            )
        elif isinstance(part, harmony.Reasoning):
            await stream.send(_chunk(h, True, None, None, logprobs=logprobs, index=index,
                                     timings=timings, reasoning=part.text))  # fmt: skip
        else:
            call = tt.ToolCallDelta(index=k, id=part.id, type="function", function=part.function)
            await stream.send(_chunk(h, True, None, None, logprobs=logprobs, index=index,
                                     calls=[call], timings=timings))  # fmt: skip
            k += 1
        logprobs = None
    if logprobs is not None:
        await stream.send(_chunk(h, True, "", None, logprobs=logprobs, index=index))
