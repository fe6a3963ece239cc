"""The HTTP front end (aiohttp). No torch here: it talks to the engine through `Backend`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec
from aiohttp import web

from stratad.jobs import Delta, Job, JobError
from stratad.server.openai import ChatCompletionRequest, error_body, to_job

log = logging.getLogger("stratad.server")


class Backend(Protocol):
    """What the server needs of the engine."""

    model_id: str
    max_context: int

    def run(self, job: Job, cancelled: Callable[[], bool]) -> Iterator[Delta]: ...


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.Response(
        status=status, body=error_body(message, kind, param), content_type="application/json"
    )


class Server:
    def __init__(self, backend: Backend, max_body_bytes: int) -> None:
        self.backend = backend
        # One engine thread: jobs run one at a time, in arrival order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
            ]
        )

    def _complete(self, job: Job) -> tuple[str, Delta]:
        text, last = [], Delta(text="")
        for delta in self.backend.run(job, lambda: False):
            text.append(delta.text)
            last = delta
        return "".join(text), last

    async def chat_completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "request body too large")
        try:
            req = msgspec.json.decode(body, type=ChatCompletionRequest)
            job = to_job(req)
        except msgspec.ValidationError as e:
            return _error(400, str(e), _param_of(str(e)))
        except msgspec.DecodeError as e:
            return _error(400, f"invalid JSON: {e}")
        except ValueError as e:
            return _error(400, str(e))
        if req.stream:
            return _error(400, "stream=true is not supported yet", "stream")
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            text, last = await loop.run_in_executor(self.executor, self._complete, job)
        except JobError as e:
            return _error(400, str(e), "messages")
        log.info(
            "chat completion: %d prompt + %d completion tokens in %.2f s (%s)",
            last.prompt_tokens, last.completion_tokens, time.monotonic() - started,
            last.finish_reason,
        )
        payload = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.backend.model_id,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
            },
        }
        return web.json_response(payload)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.backend.model_id, "object": "model", "owned_by": "strata",
                     "max_model_len": self.backend.max_context}
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.backend.model_id})


def _param_of(message: str) -> str | None:
    # msgspec says "... - at `$.messages[0].role`": the field path after "$."
    if "`$." in message:
        return message.rsplit("`$.", 1)[1].rstrip("`")
    return None
