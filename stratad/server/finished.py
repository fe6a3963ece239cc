"""A ticket's whole answer, for the routes that do not stream: its deltas to the last, or the
error response that ended it (the engine's 500, the client's 400, 503 when a drain cancelled
it). One rule for every front (OpenAI's, llama-server's, Anthropic's)."""

from __future__ import annotations

from aiohttp import web

from stratad.runtime.jobs import Delta, JobError
from stratad.runtime.scheduler import EngineFailed, Ticket
from stratad.server.errors import error_response

CANCELLED = "the request was cancelled (the server is shutting down)"


class Unfinished(Exception):
    """A ticket that ended without its last delta: `response` is the error to answer with."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


async def deltas_of(ticket: Ticket) -> list[Delta]:
    """Every delta of `ticket`, the last with its finish reason; `Unfinished` if it failed or
    was cancelled."""
    out: list[Delta] = []
    try:
        async for d in ticket.stream():
            out.append(d)
    except EngineFailed as e:
        raise Unfinished(error_response(500, str(e), None)) from None
    except JobError as e:
        raise Unfinished(error_response(400, str(e), e.param, code=e.code)) from None
    if not out or not out[-1].finish_reason:
        raise Unfinished(error_response(503, CANCELLED, None, retry_after=5))
    return out
