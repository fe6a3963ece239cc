"""The completion routes' common path: decode and check, prepare, queue, then answer or stream.
OpenAI's two routes are here; the steps are `Completions.serve`'s, which the other front ends
take too (llama-server's in `stratad.server.llama.routes`, Anthropic's in
`stratad.server.anthropic.routes`).

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
from functools import partial
from typing import Protocol, TypeVar

import msgspec
from aiohttp import web

from stratad.config import ServerConfig
from stratad.runtime.jobs import Job, JobError, PreparedJob
from stratad.runtime.scheduler import Backend, Refused, Scheduler, Ticket
from stratad.server import fields, structured
from stratad.server.errors import error_response
from stratad.server.http.sse import EventStream
from stratad.server.metrics import ServerMetrics
from stratad.server.openai import requests as oa
from stratad.server.openai.answers import Header, collect_answer, stream_answer
from stratad.server.tools import calls as tool_calls
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


def presented_key(request: web.Request) -> str:
    """The API key a request carries, as `Authorization` writes it (`Bearer <key>`); Anthropic's
    clients send it as `x-api-key`."""
    given = request.headers.get("Authorization", "")
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key is not None and not given else given


def cache_scope(request: web.Request, user: str | None) -> str:
    """Whose cached prefixes a request may reuse: its API key and its `user`, hashed (the key
    itself is kept nowhere). Clients sharing a key and sending no `user` share one scope."""
    key = presented_key(request)
    if not key and not user:
        return ""
    return hashlib.sha256(f"{key}\0{user or ''}".encode()).hexdigest()[:16]


class Asked(Protocol):
    """What the shared steps read of a decoded request."""

    @property
    def model(self) -> str | None: ...

    @property
    def user(self) -> str | None:
        """whose request it is, for its cache scope"""
        ...


R = TypeVar("R", bound=Asked)
T = TypeVar("T")


class Refusal(Exception):
    """A request answered before it runs (with an error): `response` is the answer."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class Completions:
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

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, partial(self._decode, chat=True),
                                partial(self._answer, chat=True))  # fmt: skip

    async def text(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, partial(self._decode, chat=False),
                                partial(self._answer, chat=False))  # fmt: skip

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

    async def _answer(
        self,
        request: web.Request,
        req: oa.ChatCompletionRequest | oa.CompletionRequest,
        engine: Backend,
        tickets: list[Ticket],
        chat: bool,
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
            return await stream_answer(
                self.event_stream(request), tickets, header, chat, include_usage
            )
        return await collect_answer(tickets, header, chat)

    def event_stream(self, request: web.Request) -> EventStream:
        """The SSE writer of a streamed answer, with the server's buffer and timeouts."""
        c = self.config
        return EventStream(request, c.send_buffer_bytes, c.send_timeout_s, c.sse_keepalive_s)

    # --- the steps every completion route takes ---------------------------------------------

    async def serve(
        self,
        request: web.Request,
        decode: Callable[[bytes], tuple[R, list[Job]]],
        answer: Callable[[web.Request, R, Backend, list[Ticket]], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Read the body, `decode` it (off the event loop) into the request and its jobs, queue
        them, and `answer` from their tickets; the jobs are cancelled if the client leaves."""
        try:
            body = await self.read(request)
            req, jobs = await self.decode(decode, body)
            scope = cache_scope(request, req.user)
            jobs = [msgspec.structs.replace(j, scope=scope) for j in jobs]
            engine = self.engine_for(req.model)
            tickets = await self._submit(engine, jobs)
        except Refusal as e:
            return e.response
        watchers = [asyncio.create_task(_watch(request, t)) for t in tickets]
        done = False
        try:
            response = await answer(request, req, engine, tickets)
            done = True
            return response
        finally:
            for w in watchers:
                w.cancel()
            for t in tickets:
                if not done:
                    t.cancel()
                elif t.finished is None:  # answered without it: another choice failed
                    t.cancel("request")

    async def read(self, request: web.Request) -> bytes:
        """The request's body; Refusal (408) if it does not arrive in time."""
        try:
            return await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except TimeoutError:
            late = error_response(
                408, f"the request body did not arrive within {self.config.body_timeout_s:g} s"
                " (server.body_timeout_s)", None,
            )  # fmt: skip
            late.force_close()
            raise Refusal(late) from None

    async def decode(self, decode: Callable[[bytes], T], body: bytes) -> T:
        """`decode(body)` on the decoding threads; Refusal (400) for a body it refuses."""
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._decoders, decode, body)
        except msgspec.ValidationError as e:
            raise Refusal(error_response(400, *explain(str(e)))) from None
        except msgspec.DecodeError as e:
            raise Refusal(error_response(400, f"the body is not valid JSON: {e}", None)) from None
        except RecursionError:  # JSON nested deeper than the decoder goes, anywhere in it
            raise Refusal(
                error_response(400, "the body nests JSON too deeply to read", None)
            ) from None
        except oa.RequestError as e:
            raise Refusal(error_response(400, str(e), e.param)) from None

    def engine_for(self, model: str | None) -> Backend:
        """The engine, ready and serving `model`; Refusal (503, 404) if not."""
        engine = self.scheduler.engine
        if engine is None or not self.scheduler.ready:
            self.metrics.rejected.inc(reason="unavailable")
            raise Refusal(self.unavailable())
        if not serves(engine, model):
            raise Refusal(error_response(
                404, f"The model `{model}` does not exist (this server serves"
                f" `{engine.model_id}`)", "model", code="model_not_found",
            ))  # fmt: skip
        return engine

    async def tokenize(self, engine: Backend, job: Job) -> PreparedJob:
        """`job` prepared on the tokenizer threads, not queued; Refusal (400) if refused."""
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._tokenizers, engine.prepare, job)
        except JobError as e:
            raise Refusal(error_response(400, str(e), e.param, code=e.code)) from None

    async def _submit(self, engine: Backend, jobs: list[Job]) -> list[Ticket]:
        """The jobs prepared and queued, each choice a sequence of its own, in turn; Refusal
        (400, 429, 503) if the engine or the queue refuses them."""
        tickets: list[Ticket] = []
        try:
            for i, job in enumerate(jobs):
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
                raise Refusal(error_response(400, str(e), e.param, code=e.code)) from None
            kind = "queue_full" if e.status == 429 else "unavailable"
            self.metrics.rejected.inc(reason=kind)
            raise Refusal(
                error_response(e.status, str(e), None, code=kind, retry_after=e.retry_after)
            ) from None
        except BaseException:
            for t in tickets:
                t.cancel()
            raise
        return tickets

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
