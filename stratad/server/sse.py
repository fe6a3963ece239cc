"""Server-sent events for streamed completions: `data: <json>` frames, then `data: [DONE]`.

A write to a client that has gone away raises `ClientGone`; the handler then cancels the job.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection while we were streaming to it."""


class EventStream:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # no proxy buffering: tokens must flow as made
            },
        )

    async def open(self) -> None:
        try:
            await self.response.prepare(self.request)
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone() from e

    async def send(self, event: Any) -> None:
        await self._write(b"data: " + msgspec.json.encode(event) + b"\n\n")

    async def done(self) -> None:
        await self._write(DONE)
        try:
            await self.response.write_eof()
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone() from e

    async def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as e:  # aiohttp: ClientConnectionResetError
            raise ClientGone() from e
