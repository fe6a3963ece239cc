"""The completion routes' common path: decode and check, prepare, queue, then answer or stream
(OpenAI's two routes here; llama-server's in `stratad.server.llama_routes`).

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
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
from aiohttp import web

from stratad.config import ServerConfig
from stratad.runtime.jobs import Job, JobError, PreparedJob
from stratad.runtime.scheduler import Backend, Refused, Scheduler, Ticket
from stratad.server import fields, structured, tool_calls
from stratad.server import openai as oa
from stratad.server.answers import Header, collect_answer, stream_answer
from stratad.server.errors import error_response
from stratad.server.metrics import ServerMetrics
from stratad.server.sse import EventStream
from stratad.server.validation import decode_json, explain

_CHAT_FIELDS = fields.known_fields(oa.ChatCompletionRequest)
_TEXT_FIELDS = fields.known_fields(oa.CompletionRequest)
WATCH_INTERVAL_S = 0.025
TOKENIZER_THREADS = 2  # prompts tokenized at once; the rest wait (holding their queue place)
# bodies decoded at once: a request's schema compiles there (up to seconds for a large one),
# never on the event loop, which must keep answering /health and the watchdog
DECODE_THREADS = 2


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


# what answers a request once its jobs are queued: (request, engine, tickets) -> the response
Answer = Callable[[web.Request, Backend, list[Ticket]], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Parsed:
    """A decoded completion request: its jobs (one per choice) and how to answer them."""

    jobs: list[Job]
    answer: Answer
    model: str | None = None
    """the model it names (None: whatever is served)"""
    user: str | None = None
    """the end user it names (its cached prefixes are its own)"""


class Completions:
    """The completion routes' common path: read, decode, queue, answer (`serve`)."""

    def __init__(self, scheduler: Scheduler, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.config = config
        self.default_max_tokens = config.default_max_tokens or None
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")
        self._decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="decode")

    def unavailable(self) -> web.Response:
        s = self.scheduler
        return error_response(503, f"the server is {s.status}", None, retry_after=s.retry_after())

    def event_stream(self, request: web.Request) -> EventStream:
        """The SSE writer of a streamed answer, with the server's buffer and timeouts."""
        c = self.config
        return EventStream(request, c.send_buffer_bytes, c.send_timeout_s, c.sse_keepalive_s)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, lambda body: self._decode(body, chat=True))

    async def text(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, lambda body: self._decode(body, chat=False))

    def _decode(self, body: bytes, chat: bool) -> Parsed:
        """The request's jobs, one per choice (`n` per prompt) in choice order, and its answer."""
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
        return Parsed(jobs, self._answer(req, chat), req.model, req.user)

    def _answer(self, req: oa.ChatCompletionRequest | oa.CompletionRequest, chat: bool) -> Answer:
        async def answer(
            request: web.Request, engine: Backend, tickets: list[Ticket]
        ) -> web.StreamResponse:
            header = Header(
                id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                created=int(time.time()),
                model=engine.model_id,
                n=req.n or 1,
                tools=isinstance(req, oa.ChatCompletionRequest) and tool_calls.parses_calls(req),
                timings=bool(req.timings_per_token),
            )
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                stream = self.event_stream(request)
                return await stream_answer(stream, tickets, header, chat, include_usage)
            return await collect_answer(tickets, header, chat)

        return answer

    async def serve(
        self, request: web.Request, decode: Callable[[bytes], Parsed]
    ) -> web.StreamResponse:
        """Read the body, `decode` it (on a worker thread), queue its jobs, then answer; the
        jobs are cancelled if the client leaves. Every completion route comes through here."""
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
            loop = asyncio.get_running_loop()
            parsed = await loop.run_in_executor(self._decoders, decode, body)
        except msgspec.ValidationError as e:
            return error_response(400, *explain(str(e)))
        except msgspec.DecodeError as e:
            return error_response(400, f"the body is not valid JSON: {e}", None)
        except RecursionError:  # JSON nested deeper than the decoder goes, anywhere in it
            return error_response(400, "the body nests JSON too deeply to read", None)
        except oa.RequestError as e:
            return error_response(400, str(e), e.param)
        scope = cache_scope(request, parsed.user)
        jobs = [msgspec.structs.replace(j, scope=scope) for j in parsed.jobs]
        engine = self.scheduler.engine
        if engine is None or not self.scheduler.ready:
            self.metrics.rejected.inc(reason="unavailable")
            return self.unavailable()
        if not serves(engine, parsed.model):
            return error_response(
                404, f"The model `{parsed.model}` does not exist (this server serves"
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
                return error_response(400, str(e), e.param, code=e.code)
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
            response = await parsed.answer(request, engine, tickets)
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
