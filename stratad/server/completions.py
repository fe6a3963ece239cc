"""The two completion routes: decode and check, prepare, queue, then answer or stream.

Each request's job is cancelled when its client goes away: aiohttp cancels the handler (the
daemon runs with `handler_cancellation`), a watcher polls the connection in case it does not,
and a failed SSE write says so too. The engine then stops within one prefill chunk or one
decode step (see `stratad.runtime.scheduler`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from stratad.config import ServerConfig
from stratad.runtime.jobs import Delta, Job, JobError, PreparedJob, TokenLogprob
from stratad.runtime.scheduler import Backend, EngineFailed, Refused, Scheduler, Ticket
from stratad.server import fields, structured, tool_calls
from stratad.server import openai as oa
from stratad.server import responses as rs
from stratad.server import tool_types as tt
from stratad.server.errors import error_response
from stratad.server.metrics import ServerMetrics
from stratad.server.sse import ClientGone, EventStream
from stratad.server.validation import decode_json, explain

_CHAT_FIELDS = fields.known_fields(oa.ChatCompletionRequest)
_TEXT_FIELDS = fields.known_fields(oa.CompletionRequest)
WATCH_INTERVAL_S = 0.025
TOKENIZER_THREADS = 2  # prompts tokenized at once; the rest wait (holding their queue place)


async def _watch(request: web.Request, ticket: Ticket) -> None:
    """Cancel the ticket as soon as the client's connection closes."""
    while not ticket.is_cancelled():
        transport = request.transport
        if transport is None or transport.is_closing():
            ticket.cancel()
            return
        await asyncio.sleep(WATCH_INTERVAL_S)


def cache_scope(request: web.Request, user: str | None) -> str:
    """Whose cached prefixes a request may reuse: its API key and its `user`, hashed (the key
    itself is kept nowhere). Clients sharing a key and sending no `user` share one scope."""
    key = request.headers.get("Authorization", "")
    if not key and not user:
        return ""
    return hashlib.sha256(f"{key}\0{user or ''}".encode()).hexdigest()[:16]


class Completions:
    def __init__(self, scheduler: Scheduler, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.config = config
        self.default_max_tokens = config.default_max_tokens or None
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")

    def unavailable(self) -> web.Response:
        s = self.scheduler
        return error_response(503, f"the server is {s.status}", None, retry_after=s.retry_after())

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def text(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    def _decode(
        self, body: bytes, chat: bool
    ) -> tuple[oa.ChatCompletionRequest | oa.CompletionRequest, list[Job]]:
        """The request and its jobs: one per choice (`n` per prompt), in choice order."""
        req: oa.ChatCompletionRequest | oa.CompletionRequest
        if chat:
            req = decode_json(body, oa.ChatCompletionRequest)
            jobs = oa.choices(oa.chat_job(req, self.default_max_tokens), req.n or 1)
        else:
            req = decode_json(body, oa.CompletionRequest)
            jobs = oa.completion_jobs(req)
        fields.check(body, _CHAT_FIELDS if chat else _TEXT_FIELDS)
        grammar, param = structured.response_grammar(req.response_format), "response_format"
        forced = None
        if isinstance(req, oa.ChatCompletionRequest):
            forced = tool_calls.forced_grammar(req)
        if forced is not None:
            if grammar is not None:
                raise oa.RequestError(
                    "a forced tool_choice and response_format cannot both shape the reply",
                    "tool_choice",
                )
            grammar, param = forced, "tools"
        if grammar is not None:
            jobs = [msgspec.structs.replace(j, grammar=grammar, grammar_param=param) for j in jobs]
        return req, jobs

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except TimeoutError:
            late = error_response(
                408, f"the request body did not arrive within {self.config.body_timeout_s:g} s"
                " (server.body_timeout_s)", None,
            )  # fmt: skip
            late.force_close()
            return late
        try:
            req, jobs = self._decode(body, chat)
        except msgspec.ValidationError as e:
            return error_response(400, *explain(str(e)))
        except msgspec.DecodeError as e:
            return error_response(400, f"the body is not valid JSON: {e}", None)
        except RecursionError:  # JSON nested deeper than the decoder goes, anywhere in it
            return error_response(400, "the body nests JSON too deeply to read", None)
        except oa.RequestError as e:
            return error_response(400, str(e), e.param)
        scope = cache_scope(request, req.user)
        jobs = [msgspec.structs.replace(j, scope=scope) for j in jobs]
        engine = self.scheduler.engine
        if engine is None or not self.scheduler.ready:
            self.metrics.rejected.inc(reason="unavailable")
            return self.unavailable()
        if not serves(engine, req.model):
            return error_response(
                404, f"The model `{req.model}` does not exist (this server serves"
                f" `{engine.model_id}`)", "model", code="model_not_found",
            )  # fmt: skip
        tickets: list[Ticket] = []
        try:
            for i, job in enumerate(jobs):  # each choice a sequence of its own, queued in turn
                # its place in the queue, held while it tokenizes; the request is refused or
                # let in as a whole at its first choice
                if i == 0:
                    self.scheduler.admit()
                else:
                    self.scheduler.admit_choice()
                prepared = await self._prepare(engine, job)
                tickets.append(self.scheduler.submit(prepared))
        except (JobError, Refused) as e:
            for t in tickets:
                t.cancel()
            if isinstance(e, JobError):
                return error_response(400, str(e), e.param)
            kind = "queue_full" if e.status == 429 else "unavailable"
            self.metrics.rejected.inc(reason=kind)
            return error_response(e.status, str(e), None, code=kind, retry_after=e.retry_after)
        except BaseException:
            for t in tickets:
                t.cancel()
            raise
        watchers = [asyncio.create_task(_watch(request, t)) for t in tickets]
        done = False
        try:
            header = _Header(
                id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                created=int(time.time()),
                model=engine.model_id,
                n=req.n or 1,
                tools=isinstance(req, oa.ChatCompletionRequest) and tool_calls.parses_calls(req),
            )
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                stream = EventStream(
                    request, self.config.send_buffer_bytes, self.config.send_timeout_s,
                    self.config.sse_keepalive_s,
                )  # fmt: skip
                response = await _stream(stream, tickets, header, chat, include_usage)
            else:
                response = await _collect(tickets, header, chat)
            done = True
            return response
        finally:
            for w in watchers:
                w.cancel()
            if not done:
                for t in tickets:
                    t.cancel()

    async def _prepare(self, engine: Backend, job: Job) -> PreparedJob:
        """Tokenize on the tokenizer threads (the tokenizer lets go of the GIL while it works,
        so the event loop keeps answering); an admitted job that fails gives its place back."""
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._tokenizers, engine.prepare, job)
        except BaseException:  # bad input, or the client left (cancelled)
            self.scheduler.withdraw()
            raise


def serves(engine: Backend, model: str | None) -> bool:
    """Whether a request's `model` names the served model: its id or an alias (an engine may
    declare `model_aliases`; `"*"` among them accepts any name). No name asks for it too."""
    if not model or model == engine.model_id:
        return True
    aliases: tuple[str, ...] = getattr(engine, "model_aliases", ())
    return model in aliases or "*" in aliases


class _Header(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    n: int = 1  # choices per prompt
    tools: bool = False  # the replies are read for tool calls


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


async def _collect(tickets: list[Ticket], h: _Header, chat: bool) -> web.Response:
    choices: list[_Choice] = []
    try:
        for ticket in tickets:
            choices.append(c := _Choice())
            async for d in ticket.stream():
                c.add(d)
    except EngineFailed as e:
        return error_response(500, str(e), None)
    except JobError as e:
        return error_response(400, str(e), e.param)
    lasts = [c.last for c in choices if c.last is not None and c.last.finish_reason]
    if len(lasts) < len(tickets):
        return error_response(
            503, "the request was cancelled (the server is shutting down)", None, retry_after=5
        )
    asked = tickets[0].prepared.job.logprobs is not None
    usage = _usage_of(lasts, h.n)
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
                    message=(m := tool_calls.reply_message("".join(c.parts), h.tools)),
                    finish_reason=tool_calls.finish_reason(last.finish_reason, bool(m.tool_calls)),
                    logprobs=rs.chat_logprobs(c.logprobs) if asked else None,
                )
                for i, (c, last) in enumerate(zip(choices, lasts, strict=True))
            ],
            usage=usage,
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
        )
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def _chunk(
    h: _Header,
    chat: bool,
    text: str | None,
    finish: str | None,
    role: bool = False,
    logprobs: TokenLogprob | None = None,
    offset: int = 0,
    index: int = 0,
    calls: list[tt.ToolCallDelta] | None = None,
) -> msgspec.Struct:
    """One streamed event; `offset`: where `logprobs`' token starts in the completion text."""
    if chat:
        delta = rs.ChunkDelta(role="assistant" if role else None, content=text, tool_calls=calls)
        lp = rs.chat_logprobs([logprobs]) if logprobs is not None else None
        return rs.ChatCompletionChunk(
            id=h.id,
            object="chat.completion.chunk",
            created=h.created,
            model=h.model,
            choices=[rs.ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)],
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
    )


async def _stream(
    stream: EventStream, tickets: list[Ticket], h: _Header, chat: bool, include_usage: bool
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
    stream: EventStream, ticket: Ticket, h: _Header, chat: bool, index: int, lasts: list[Delta]
) -> bool:
    """Stream one choice; its final delta goes to `lasts`. False if it failed or was cut."""
    if chat:
        await stream.send(_chunk(h, chat, "", None, role=True, index=index))
    last: Delta | None = None
    offset = 0
    reader = tool_calls.CallReader() if chat and h.tools else None
    try:
        async for d in ticket.stream():
            last = d
            if reader is not None:
                await _send_read(stream, reader, d, h, index)
            elif d.text or d.logprobs:
                await stream.send(_chunk(h, chat, d.text, None, logprobs=d.logprobs,
                                         offset=offset, index=index))  # fmt: skip
                offset += len(d.logprobs.token) if d.logprobs else 0
            if d.finish_reason:
                called = reader is not None and reader.calls > 0
                finish = tool_calls.finish_reason(d.finish_reason, called)
                await stream.send(_chunk(h, chat, None if chat else "", finish, index=index))
    except (EngineFailed, JobError) as e:
        await stream.send(msgspec.json.decode(rs.error_body(str(e), "server_error", None)))
        return False
    if last is None or not last.finish_reason:  # cancelled by a drain, not the client
        await stream.send(
            msgspec.json.decode(
                rs.error_body(
                    "the request was cancelled (the server is shutting down)",
                    "server_error",
                    None,
                )
            )
        )
        return False
    lasts.append(last)
    return True


async def _send_read(
    stream: EventStream, reader: tool_calls.CallReader, d: Delta, h: _Header, index: int
) -> None:
    """A delta of a reply read for tool calls, in order: its text once known not to be a call,
    each call made; the token's logprobs, if asked, with the first chunk (alone if the text is
    held)."""
    k = reader.calls  # the index of the next call
    parts = reader.feed(d.text) + (reader.finish() if d.finish_reason else [])
    logprobs = d.logprobs
    for part in parts:
        if isinstance(part, str):
            await stream.send(_chunk(h, True, part, None, logprobs=logprobs, index=index))
        else:
            call = tt.ToolCallDelta(index=k, id=part.id, type="function", function=part.function)
            await stream.send(
                _chunk(h, True, None, None, logprobs=logprobs, index=index, calls=[call])
            )
            k += 1
        logprobs = None
    if logprobs is not None:
        await stream.send(_chunk(h, True, "", None, logprobs=logprobs, index=index))
