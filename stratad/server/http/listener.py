"""Where HTTP connections arrive: the listening site, its connection cap, its timeouts, and
accept errors logged once in a while instead of once per attempt.

A client must not hold the daemon's sockets for free: a connection with no request under way
closes after `server.idle_timeout_s` (aiohttp's keep-alive timer, which also runs from the
connect to a complete request head, so a slow-header client is bounded by it too); a body gets
`server.body_timeout_s` (`stratad.server.completions`); a stream whose client stops reading
gets `server.send_timeout_s` (`stratad.server.http.sse`). Past `server.max_connections` open
connections a new one is answered 503 and closed at once, so the cap, set under the open-file
limit, keeps descriptors for /health's answers, the control socket and the model's files.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_server import Server as WebServer

from stratad.config import ServerConfig

log = logging.getLogger("stratad.server")

FD_RESERVE = 64  # descriptors left to the rest of the daemon under the open-file limit
LOG_EVERY_S = 10.0  # at most one line per this many seconds per kind of trouble
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def handler_args(config: ServerConfig) -> dict[str, Any]:
    """aiohttp's per-connection settings (`web.AppRunner(app, **handler_args(config))`)."""
    return {
        "keepalive_timeout": config.idle_timeout_s,
        # after an answer that left the body unread (413, 408): read and drop it this long
        "lingering_time": min(config.body_timeout_s, 10.0),
        "logger": _HTTP_LOG,
    }


class MalformedRequests(logging.Filter):
    """aiohttp answers a request it cannot parse (a NUL byte in a header, a broken request
    line) with 400 and logs it as an ERROR with a traceback: a client's doing, as often as a
    client likes. Such a record becomes one WARNING line now and then; the others pass."""

    def __init__(self) -> None:
        super().__init__()
        self._say = RateLimitedLog(log)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        what = " ".join(str(exc.message).split())[:200]
        self._say(logging.WARNING, "answered a malformed request from %s with %d: %s",
                  remote, exc.code, what)  # fmt: skip
        return False


_HTTP_LOG = logging.getLogger("stratad.server.http")  # aiohttp's request handlers log here


class RateLimitedLog:
    """One log line per `every_s` for a recurring trouble, with how often it happened."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last = -float("inf")
        self._count = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        repeats = f" ({self._count} times in {self.every_s:.0f} s)" if self._count > 1 else ""
        self.logger.log(level, message + repeats, *args)
        self._last, self._count = now, 0


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, logger: logging.Logger) -> None:
    """Log a loop's accept failures from exhausted resources (EMFILE, ...) one line at a time.

    asyncio reports each such failure with a traceback and retries the accept a second later;
    under a low open-file limit that is a traceback per listening socket per second, which
    buries the log. Other exceptions go to the default handler.
    """
    say = RateLimitedLog(logger)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            say(logging.WARNING, "cannot accept connections: %s (the open-file limit is %d)",
                exc.strerror or exc, _nofile())  # fmt: skip
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(configured: int) -> int:
    """`server.max_connections`, lowered to what the open-file limit leaves (with a WARNING)."""
    soft = _nofile()
    if soft == resource.RLIM_INFINITY:
        return configured
    room = max(soft - _open_fds() - FD_RESERVE, 1)
    if room < configured:
        log.warning(
            "server.max_connections = %d, but the open-file limit (%d) leaves room for %d:"
            " at most %d connections (raise LimitNOFILE)", configured, soft, room, room,
        )  # fmt: skip
        return room
    return configured


_BUSY_BODY = (
    b'{"error":{"message":"too many open connections; retry later","type":"server_error",'
    b'"param":null,"code":"too_many_connections"}}'
)
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_BUSY_BODY)
) + _BUSY_BODY


ACCEPT_BATCH = 32  # connections accepted per wake-up of the loop, at most
ACCEPT_PAUSE_S = 0.2  # after the process ran out of descriptors: the accepts wait this long


def _listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for every address `host` names (as asyncio's
    create_server makes them); OSError if one cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)  # fmt: skip
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:  # as asyncio's own server words it
                raise OSError(e.errno, f"error while attempting to bind on address {address!r}:"
                              f" {(e.strerror or str(e)).lower()}") from None  # fmt: skip
            sock.listen(128)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class CappedSite(web.BaseSite):
    """A TCP site that never holds more than `max_connections` connections: it accepts them
    itself (asyncio's server accepts up to 128 at a time before counting any, which ran a
    256-descriptor daemon out of descriptors in a burst of connects), a few per wake-up,
    answers one past the cap with 503 and closes it at once, and when the process has run
    out of descriptors anyway stops accepting for a moment instead of retrying each one."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int) -> None:
        super().__init__(runner)
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.refused = 0
        self.started = False
        self._socks: list[socket.socket] = []
        self._pending = 0  # accepted, not yet handed to aiohttp
        self._say = RateLimitedLog(log)
        self._say_fds = RateLimitedLog(log)

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def open_connections(self) -> int:
        server = self._runner.server
        assert isinstance(server, WebServer)
        return len(server.connections) + self._pending

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._socks = _listening_sockets(self.host, self.port)
        for sock in self._socks:
            loop.add_reader(sock.fileno(), self._accept, loop, sock)
        self.started = True

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._socks:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._socks = []
        await super().stop()

    def _accept(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno not in _RESOURCE_ERRNOS:
                    raise
                self._say_fds(logging.WARNING, "cannot accept connections: %s (the open-file"
                              " limit is %d)", e.strerror or e, _nofile())  # fmt: skip
                loop.remove_reader(sock.fileno())
                loop.call_later(ACCEPT_PAUSE_S, self._resume, loop, sock)
                return
            if self.open_connections >= self.max_connections:
                self.refused += 1
                self._say(logging.WARNING, "refused a connection: %d are open"
                          " (server.max_connections)", self.max_connections)  # fmt: skip
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(BUSY)
                conn.close()
                continue
            self._pending += 1
            loop.create_task(self._connect(loop, conn))

    def _resume(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        if sock in self._socks:  # not stopped meanwhile
            loop.add_reader(sock.fileno(), self._accept, loop, sock)

    async def _connect(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        server = self._runner.server
        assert isinstance(server, WebServer)
        try:
            await loop.connect_accepted_socket(server, conn)
        except OSError:
            conn.close()
        finally:
            self._pending -= 1


_HTTP_LOG.addFilter(MalformedRequests())
