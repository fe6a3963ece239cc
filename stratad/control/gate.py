"""Where the control socket meets the HTTP side: request counting and `drain`.

`gate_middleware` counts the API requests in flight and, once a drain has begun, refuses new
ones with 503 and `Retry-After` (and answers `/health` with 503, so a load balancer moves on)
while the ones in flight finish. `MeteredBackend` wraps the engine to count tokens and time
the two stages every request has (prompt, then generation).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from stratad.control.state import DaemonState
from stratad.runtime.jobs import Delta, Job

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DRAIN_RETRY_AFTER_S = 30


def _draining_response() -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": "the server is draining: it finishes in-flight requests and takes"
                " no new ones",
                "type": "server_error",
                "param": None,
                "code": "draining",
            }
        },
        status=503,
        headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
    )


def gate_middleware(state: DaemonState) -> Any:
    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            if request.path == "/health" and state.draining.is_set():
                return web.json_response({"status": "draining"}, status=503)
            return await handler(request)
        if state.draining.is_set() and request.method == "POST":
            state.meter.refuse()
            return _draining_response()
        state.meter.started()
        try:
            return await handler(request)
        finally:
            state.meter.finished()
            state.request_done()

    return gate


class MeteredBackend:
    """The engine, counted: tokens per request, time to the first token, generation time."""

    def __init__(self, backend: Any, state: DaemonState) -> None:
        self._backend = backend
        self._meter = state.meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def run(self, job: Job, cancelled: Callable[[], bool]) -> Iterator[Delta]:
        t0 = time.monotonic()
        first: float | None = None
        last: Delta | None = None
        try:
            for delta in self._backend.run(job, cancelled):
                if first is None:
                    first = time.monotonic()
                    self._meter.stage("prompt", first - t0)
                last = delta
                yield delta
        finally:
            if first is not None:
                self._meter.stage("generation", time.monotonic() - first)
            if last is not None:
                self._meter.tokens(last.prompt_tokens, last.completion_tokens)
