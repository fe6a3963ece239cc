"""Clients that hold the daemon's sockets: idle and slow-header connections, slow bodies,
connections past the cap, a stream whose client never reads, and accept errors under a low
open-file limit. One tiny-moe daemon with one-second timeouts and a cap of six connections."""

from __future__ import annotations

import json
import os
import resource
import socket
import time
import urllib.parse

import psutil
import pytest

from tests.server_helpers import Daemon, shared_daemon


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("limits")


def _connect(daemon: Daemon, rcvbuf: int = 0) -> socket.socket:
    host, port = urllib.parse.urlsplit(daemon.url).netloc.split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the daemon closes `sock` (reading and dropping what it sends)."""
    t0 = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - t0


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def test_idle_and_slow_header_connections_are_closed(daemon: Daemon) -> None:
    with _connect(daemon) as kept:  # one answer, then idle on a kept-alive connection
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_after(kept) < 3
    with _connect(daemon) as slow:  # a head that never ends
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(0.5)
        slow.sendall(b"X-Slow: 1\r\n")
        assert _closed_after(slow) < 3


def test_a_slow_body_gets_408(daemon: Daemon) -> None:
    with _connect(daemon) as sock:
        sock.sendall(HEAD + b'Content-Length: 100\r\n\r\n{"prompt"')
        t0 = time.monotonic()
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"server.body_timeout_s" in answer and time.monotonic() - t0 < 3
        assert _closed_after(sock) < 2  # after a lingering read of what it sends


def test_connections_past_the_cap_get_503(daemon: Daemon) -> None:
    held = [_connect(daemon) for _ in range(6)]
    try:
        time.sleep(0.1)
        with _connect(daemon) as extra:
            answer = extra.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert daemon.get("/health")[0] == 200
    assert "refused a connection: 6 are open (server.max_connections)" in daemon.log.read_text()


def test_a_stream_whose_client_does_not_read_is_given_up(daemon: Daemon) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3000, "stream": True,
                       "seed": 1}).encode()  # fmt: skip
    with _connect(daemon, rcvbuf=4096) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 60
        while "stream given up" not in daemon.log.read_text():
            assert time.monotonic() < deadline, "the stalled stream was never given up"
            time.sleep(0.1)
    time.sleep(0.2)
    assert "request cancelled (client) after" in daemon.log.read_text()
    assert daemon.health()["running"] == 0


def _pid(daemon: Daemon) -> int:
    port = int(daemon.url.rsplit(":", 1)[1])
    return next(
        c.pid
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == "LISTEN" and c.pid
    )


def test_accept_errors_are_logged_once_in_a_while(daemon: Daemon) -> None:
    pid = _pid(daemon)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 1, hard))
    try:
        held = [_connect(daemon) for _ in range(5)]  # queued by the kernel, not accepted
        time.sleep(3.5)  # asyncio retries an accept every second
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    for sock in held:
        sock.close()
    log = daemon.log.read_text()
    assert log.count("cannot accept connections: Too many open files") == 1
    assert "Traceback" not in log and "socket.accept() out of system resource" not in log
    time.sleep(1.5)
    assert daemon.get("/health")[0] == 200


def test_a_burst_past_the_cap_never_runs_the_daemon_out_of_descriptors(daemon: Daemon) -> None:
    """40 connects at once with descriptors for the cap (6) and two more: six are served,
    34 get 503 at once, and the accepts never fail (asyncio's own server took up to 128
    connections before counting one: a 256-descriptor daemon ran out in a burst of 300)."""
    pid = _pid(daemon)
    said = daemon.log.read_text().count("cannot accept connections")
    time.sleep(1.5)  # the earlier tests' connections closed (idle_timeout_s = 1)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 8, hard))
    try:
        burst = [_connect(daemon) for _ in range(40)]
        answers = []
        for sock in burst:
            sock.settimeout(5)
            answers.append(sock.recv(65536))
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    for sock in burst:
        sock.close()
    assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) == 34
    assert daemon.log.read_text().count("cannot accept connections") == said
    time.sleep(1.5)
    assert daemon.get("/health")[0] == 200


def test_malformed_requests_get_400_and_one_line_in_a_while(daemon: Daemon) -> None:
    """aiohttp logs a request head it cannot parse as an ERROR with a traceback; a client
    could fill the log with them. Found by schemathesis's probe (a NUL byte in a header)."""
    for head in (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Probe: \x00\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Probe: \x00\r\n\r\n"):  # fmt: skip
        with _connect(daemon) as sock:
            sock.sendall(head)
            assert sock.recv(65536).split(b" ", 2)[1] == b"400"
    log = daemon.log.read_text()
    assert log.count("WARNING stratad.server: answered a malformed request from 127.0.0.1") == 1
    assert "Traceback" not in log and "Error handling request" not in log


def test_log_has_no_errors(daemon: Daemon) -> None:
    assert daemon.log_errors() == []
