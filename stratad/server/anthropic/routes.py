"""The routes of Anthropic's Messages API, `POST /v1/messages` and
`POST /v1/messages/count_tokens`, on the daemon's port beside OpenAI's.

A message request takes the OpenAI routes' steps (`Completions.serve`: read, decode off the
event loop, queue, cancel when the client leaves) with its own decoding (`requests`) and
answer (`answers`, both in this package). Every error on these paths, the guard's included,
is written in OpenAI's shape where it arises and rewritten into Anthropic's on the way out
(`anthropic_error`).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from stratad.runtime.jobs import Job
from stratad.runtime.scheduler import Backend, Ticket
from stratad.server import fields
from stratad.server.anthropic import answers as aa
from stratad.server.anthropic import requests as am
from stratad.server.completions import Completions, Refusal
from stratad.server.validation import decode_json

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
_FIELDS = fields.known_fields(am.MessagesRequest)
_COUNT_FIELDS = fields.known_fields(am.CountTokensRequest)


def owns(path: str) -> bool:
    """Whether `path` is Anthropic's API (its errors are written in Anthropic's shape)."""
    return path == MESSAGES or path.startswith(MESSAGES + "/")


def anthropic_error(response: web.StreamResponse) -> web.StreamResponse:
    """An error response in OpenAI's shape rewritten into Anthropic's, its status and headers
    kept; any other response as it is."""
    if response.status < 400 or not isinstance(response, web.Response):
        return response
    if not isinstance(response.body, bytes) or response.content_type != "application/json":
        return response
    try:
        body = msgspec.json.decode(response.body)
        message = body["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return response
    response.body = msgspec.json.encode(aa.error_body(response.status, str(message)))
    return response


class Messages:
    """The two handlers, on the OpenAI routes' `Completions` steps."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self.completions.serve(request, self._decode, self._answer)

    def _decode(self, body: bytes) -> tuple[am.MessagesRequest, list[Job]]:
        req = decode_json(body, am.MessagesRequest)
        job = am.messages_job(req)
        fields.check(body, _FIELDS)
        return req, [job]

    async def _answer(
        self, request: web.Request, req: am.MessagesRequest, engine: Backend, tickets: list[Ticket]
    ) -> web.StreamResponse:
        (ticket,) = tickets
        h = aa.header(engine.model_id, am.parses_calls(req))
        if req.stream:
            return await aa.stream_message(self.completions.event_stream(request), ticket, h)
        return await aa.collect_message(ticket, h)

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """The prompt's tokens, as a message request with this conversation would have them
        (tokenized on the tokenizer threads, never queued)."""
        c = self.completions
        try:
            body = await c.read(request)
            req, job = await c.decode(self._decode_count, body)
            engine = c.engine_for(req.model)
            prepared = await c.tokenize(engine, job)
        except Refusal as e:
            return e.response
        body = msgspec.json.encode(aa.CountTokensResponse(input_tokens=len(prepared.prompt)))
        return web.Response(body=body, content_type="application/json")

    def _decode_count(self, body: bytes) -> tuple[am.CountTokensRequest, Job]:
        req = decode_json(body, am.CountTokensRequest)
        job = am.count_job(req)
        fields.check(body, _COUNT_FIELDS)
        return req, job
