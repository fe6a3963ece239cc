"""llama-server's native API beside OpenAI's, on the same port: `POST /completion` (and its
alias `/completions`), `POST /infill`, `POST /apply-template`, `GET /props` and `GET /slots`.

The completions go through the same path as OpenAI's (`Completions.serve`: the queue, the
scheduler, cancellation when the client leaves, the error bodies); only the request and answer
shapes are llama-server's (`llama_requests`, `llama_answers`). Every route here is behind
`server.api_key` when one is set, as the /v1 routes are. /slots never shows a running
request's prompt, stop strings or grammar.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from stratad import __version__
from stratad.runtime.jobs import Job, Tool
from stratad.runtime.scheduler import Backend, Ticket
from stratad.runtime.template_form import template_message, template_tools
from stratad.server import fields
from stratad.server.completions import Completions
from stratad.server.errors import error_response, param_of
from stratad.server.llama import answers as la
from stratad.server.llama import infill
from stratad.server.llama import requests as lr
from stratad.server.openai import requests as oa
from stratad.server.validation import decode_json, explain

PATHS = frozenset({"/completion", "/completions", "/infill", "/apply-template", "/props",
                   "/slots"})  # fmt: skip
_KNOWN = {
    lr.CompletionRequest: fields.known_fields(lr.CompletionRequest),
    lr.InfillRequest: fields.known_fields(lr.InfillRequest),
}


# what answers a request once its jobs are queued: (request, engine, tickets) -> the response
Answer = Callable[[web.Request, Backend, list[Ticket]], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Parsed:
    """A decoded llama-server request: its jobs (one per prompt) and how to answer them."""

    jobs: list[Job]
    answer: Answer
    model: str | None = None
    """the model it names (None: whatever is served)"""
    user: str | None = None
    """the end user it names (its cached prefixes are its own)"""


def _with_jobs(parsed: Parsed) -> tuple[Parsed, list[Job]]:
    return parsed, parsed.jobs


async def _answer_parsed(
    request: web.Request, parsed: Parsed, engine: Backend, tickets: list[Ticket]
) -> web.StreamResponse:
    return await parsed.answer(request, engine, tickets)


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class NextToken(_Struct, frozen=True):
    has_next_token: bool
    has_new_line: bool
    n_remain: int
    n_decoded: int


class Slot(_Struct, frozen=True):
    """One place where a request runs (the engine runs `total_slots` at once)."""

    id: int
    id_task: int
    n_ctx: int
    speculative: bool
    is_processing: bool
    params: la.Params
    next_token: NextToken


class Modalities(_Struct, frozen=True):
    vision: bool = False
    audio: bool = False


class Props(_Struct, frozen=True):
    """The server's settings, as llama-server's GET /props gives them."""

    default_generation_settings: Slot
    total_slots: int
    model_path: str
    model_alias: str
    chat_template: str
    chat_template_caps: dict[str, Any]
    modalities: Modalities
    build_info: str
    is_sleeping: bool


class LlamaRoutes:
    """The handlers; `codec` is set once the model has loaded."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self.scheduler = completions.scheduler
        self.codec: lr.LlamaCodec | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="template")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/completion", self.completion),
            web.post("/completions", self.completion),
            web.post("/infill", self.infill),
            web.post("/apply-template", self.apply_template),
            web.get("/props", self.props),
            web.get("/slots", self.slots),
        ]

    # --- completions ---------------------------------------------------------------------

    async def completion(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, lr.CompletionRequest)

    async def infill(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, lr.InfillRequest)

    async def _serve(
        self, request: web.Request, kind: type[lr.CompletionRequest]
    ) -> web.StreamResponse:
        codec = self.codec
        if codec is None:
            return self.completions.unavailable()
        return await self.completions.serve(
            request, lambda body: _with_jobs(self._decode(body, kind, codec)), _answer_parsed
        )

    def _decode(
        self, body: bytes, kind: type[lr.CompletionRequest], codec: lr.LlamaCodec
    ) -> Parsed:
        req = decode_json(body, kind)
        lr.check_fields(body, _KNOWN[kind])
        if isinstance(req, lr.InfillRequest):
            prompts: list[str | tuple[int, ...]] = [infill.infill_prompt(req, codec)]
        else:
            prompts = lr.prompts(req.prompt, codec)
        jobs = lr.jobs_of(req, prompts, codec, self.completions.default_max_tokens)
        texts = [p if isinstance(p, str) else codec.decode(list(p)) for p in prompts]

        async def answer(
            request: web.Request, engine: Backend, tickets: list[Ticket]
        ) -> web.StreamResponse:
            a = la.Answer(model=engine.model_id, stream=req.stream, prompts=texts,
                          timings_per_token=req.timings_per_token,
                          return_tokens=req.return_tokens or req.stream)  # fmt: skip
            if req.stream:
                return await la.stream(self.completions.event_stream(request), a, tickets)
            return await la.collect(a, tickets)

        return Parsed(jobs, answer, req.model)

    # --- the chat template ---------------------------------------------------------------

    async def apply_template(self, request: web.Request) -> web.Response:
        codec = self.codec
        if codec is None:
            return self.completions.unavailable()
        timeout = self.completions.config.body_timeout_s
        try:
            body = await asyncio.wait_for(request.read(), timeout)
        except TimeoutError:
            return error_response(408, f"the request body did not arrive within {timeout:g} s"
                                  " (server.body_timeout_s)", None)  # fmt: skip
        try:
            req = decode_json(body, lr.ApplyTemplateRequest)
            messages = [template_message(oa.chat_message(m, i))
                        for i, m in enumerate(req.messages)]  # fmt: skip
            tools = template_tools(Job(tools=tuple(
                Tool(t.function.name, t.function.description, t.function.parameters)
                for t in req.tools or ()
            )))  # fmt: skip
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(
                self._pool, codec.chat_text, messages, req.add_generation_prompt, tools
            )
        except msgspec.ValidationError as e:
            return error_response(400, *explain(str(e)))
        except (msgspec.DecodeError, RecursionError):
            return error_response(400, "the body is not valid JSON", None)
        except oa.RequestError as e:
            return error_response(400, str(e), e.param)
        except ValueError as e:  # the template refused the conversation (e.g. role order)
            return error_response(400, str(e), param_of(str(e)) or "messages")
        return _json(lr.PromptText(prompt=text))

    # --- the server's state --------------------------------------------------------------

    def _idle(self, i: int, n_ctx: int) -> Slot:
        return Slot(
            id=i, id_task=-1, n_ctx=n_ctx, speculative=False, is_processing=False,
            params=la.params_of(None), next_token=NextToken(
                has_next_token=True, has_new_line=False, n_remain=-1, n_decoded=0),
        )  # fmt: skip

    async def props(self, request: web.Request) -> web.Response:
        engine = self.scheduler.engine
        codec = self.codec
        if engine is None or codec is None:
            return self.completions.unavailable()
        return _json(Props(
            default_generation_settings=self._idle(0, engine.max_context),
            total_slots=self.scheduler.parallel,
            model_path=str(getattr(engine, "model_path", engine.model_id)),
            model_alias=engine.model_id,
            chat_template=codec.chat_template or "",
            chat_template_caps={},
            modalities=Modalities(),
            build_info=f"strata {__version__}",
            is_sleeping=False,
        ))  # fmt: skip

    async def slots(self, request: web.Request) -> web.Response:
        """One entry per place: those running first (their settings and progress, not their
        prompt, stop strings or grammar), then the idle ones; `?fail_on_no_slot=1` answers
        503 while none is idle."""
        engine = self.scheduler.engine
        if engine is None:
            return self.completions.unavailable()
        running = list(self.scheduler.running)
        total = self.scheduler.parallel
        if request.query.get("fail_on_no_slot") in ("1", "true") and len(running) >= total:
            return error_response(503, "no slot available", None, retry_after=1)
        out = [_busy(i, t, engine.max_context) for i, t in enumerate(running[:total])]
        out += [self._idle(i, engine.max_context) for i in range(len(out), total)]
        return _json(out)


def _busy(i: int, ticket: Ticket, n_ctx: int) -> Slot:
    job = msgspec.structs.replace(ticket.prepared.job, stop=(), grammar=None)  # not shown
    decoded = ticket.last.completion_tokens if ticket.last else 0
    return Slot(
        id=i, id_task=i, n_ctx=n_ctx, speculative=False, is_processing=True,
        params=la.params_of(job, stream=False), next_token=NextToken(
            has_next_token=True, has_new_line=False,
            n_remain=ticket.prepared.max_tokens - decoded, n_decoded=decoded),
    )  # fmt: skip


def _json(body: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
