"""Where the control socket meets the HTTP side: request counting and `drain`.

`gate_middleware` counts the API requests in flight and, once a drain has begun, refuses new
ones with 503 and `Retry-After` (and answers `/health` with 503, so a load balancer moves on)
while the ones in flight finish. `meter_ticket` counts each finished request's tokens and
times the two stages every request has (prompt, then generation), from the scheduler's own
account of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stratad.control.state import DaemonState

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


def meter_ticket(state: DaemonState, ticket: Any) -> None:
    """A finished `stratad.runtime.scheduler.Ticket` into the control socket's meter."""
    if ticket.started is None:  # cancelled while it waited: never ran
        return
    meter = state.meter
    if ticket.first_token is not None:
        meter.stage("prompt", ticket.first_token - ticket.started)
        meter.stage("generation", ticket.finished - ticket.first_token)
    if ticket.last is not None:
        meter.tokens(ticket.last.prompt_tokens, ticket.last.completion_tokens)
