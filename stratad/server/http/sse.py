"""Server-sent events for streamed completions: `data: <json>` frames, then `data: [DONE]`
(OpenAI's), or `event: <name>` and `data: <json>` frames up to the stream's end (Anthropic's).

A write to a client that has gone away raises `ClientGone`; the handler then cancels the job.
So does a client that stops reading: once `send_buffer_bytes` of events wait in the daemon for
it, a write waits for it to take them, and after `send_timeout_s` of that the stream is given up
(`ClientStalled`) and the connection aborted, so that neither the job nor the buffer is held for
a reader that never comes.

While nothing comes to send (the request waits in the queue, or a long prompt is prefilled
before the first token), a timer task writes an SSE comment (`: keep-alive`) after every
`keepalive_s` without a write: clients skip comments, and proxies and read timeouts see the
connection alive. It writes only into an empty send buffer (a client that reads nothing gets
no more bytes) and never while an event is being written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

import msgspec
from aiohttp import web

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


log = logging.getLogger("stratad.server")


class ClientGone(Exception):
    """The client closed the connection while we were streaming to it."""


class ClientStalled(ClientGone):
    """The client took nothing of a full send buffer for the send timeout."""


class EventStream:
    def __init__(
        self,
        request: web.Request,
        send_buffer_bytes: int = 1 << 20,
        send_timeout_s: float = 30.0,
        keepalive_s: float = 15.0,
    ) -> None:
        self.request = request
        self.keepalive_s = keepalive_s
        self._last_write = time.monotonic()
        self._writing = False
        self._keepalive: asyncio.Task[None] | None = None
        self.send_buffer_bytes = send_buffer_bytes
        self.send_timeout_s = send_timeout_s
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # no proxy buffering: tokens must flow as made
            },
        )

    async def open(self) -> None:
        transport = self.request.transport
        if transport is not None:  # writes wait for the client past this many queued bytes
            transport.set_write_buffer_limits(high=self.send_buffer_bytes)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # and the kernel's buffer is bounded alike (not autotuned)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        try:
            await self.response.prepare(self.request)
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone() from e
        self._last_write = time.monotonic()
        self._keepalive = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        """Until the stream ends: a comment after every `keepalive_s` without a write."""
        while True:
            await asyncio.sleep(max(self._last_write + self.keepalive_s - time.monotonic(), 0))
            transport = self.request.transport
            if transport is None or transport.is_closing():
                return
            due = time.monotonic() - self._last_write >= self.keepalive_s
            if due and not self._writing and transport.get_write_buffer_size() == 0:
                try:
                    await self.response.write(KEEPALIVE)
                except (ConnectionError, RuntimeError):
                    return  # the handler finds out on its next write
                self._last_write = time.monotonic()
            elif due:
                self._last_write = time.monotonic()  # busy or full: look again one period on

    async def send(self, event: Any, name: str | None = None) -> None:
        """One event: its `data` the JSON of `event`, its `event` line `name` if given."""
        head = b"event: " + name.encode() + b"\n" if name else b""
        await self._write(head + b"data: " + msgspec.json.encode(event) + b"\n\n")

    async def done(self) -> None:
        """`data: [DONE]`, and the end of the stream."""
        self.stop_keepalive()
        await self._write(DONE)
        await self.end()

    async def end(self) -> None:
        """Close the stream: after `done`'s marker, or without one (llama-server sends none)."""
        self.stop_keepalive()
        try:
            await asyncio.wait_for(self.response.write_eof(), self.send_timeout_s)
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone() from e
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ClientStalled() from None

    def stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()

    async def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            self.stop_keepalive()
            raise ClientGone()
        self._writing = True
        try:
            await asyncio.wait_for(self._send(transport, data), self.send_timeout_s)
        except (ConnectionError, RuntimeError) as e:  # aiohttp: ClientConnectionResetError
            self.stop_keepalive()
            raise ClientGone() from e
        except TimeoutError:
            self.stop_keepalive()
            queued = transport.get_write_buffer_size()
            log.info("stream given up: its client read nothing of %d queued bytes for %.0f s",
                     queued, self.send_timeout_s)  # fmt: skip
            transport.abort()
            raise ClientStalled() from None
        finally:
            self._writing = False
            self._last_write = time.monotonic()

    async def _send(self, transport: asyncio.Transport, data: bytes) -> None:
        await self.response.write(data)
        if transport.get_write_buffer_size() > self.send_buffer_bytes:
            await self.request.writer.drain()  # returns once the client took enough
