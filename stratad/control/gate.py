"""Where the control socket meets the HTTP side: request counting.

`gate_middleware` counts the API requests in flight and how each ended (refused with 429 or
503, e.g. while draining, or answered); `meter_ticket` counts each finished request's tokens
and times the two stages every request has (prompt, then generation), from the scheduler's own
account of it. The drain itself is the scheduler's (`stratad.runtime.scheduler`): the HTTP
guard refuses by its state, and the control socket's `drain` sets it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stratad.control.state import DaemonState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def gate_middleware(state: DaemonState) -> Any:
    """Install outermost, so that it sees every refusal of the handlers and the guard."""

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        state.meter.started()
        refused = False
        try:
            response = await handler(request)
            refused = response.status in (429, 503)
            return response
        finally:
            state.meter.finished(refused)

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
