"""Stopping a real tiny-moe daemon with real signals: a request on a kept-alive connection
after SIGTERM gets 503 with Retry-After at once while a long request drains; a second SIGTERM
stops it now; a SIGTERM in the first moments of start-up ends it cleanly, with a log line."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.daemon import free_port
from tests.server_helpers import tiny_moe_path, wait_until

CONFIG = """
[server]
drain_timeout_s = 60.0
[control]
socket = ""
[engine]
threads = 1
"""


def _start(tmp_path: Path, extra: str = "") -> tuple[subprocess.Popen[bytes], int, Path]:
    config = tmp_path / "stratad.toml"
    config.write_text(extra + CONFIG)
    log = tmp_path / "stratad.log"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stratad", str(tiny_moe_path()), "--config", str(config),
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return proc, port, log


def _send(sock: socket.socket, method: str, path: str, body: bytes = b"") -> None:
    sock.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def _serving(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            _send(sock, "GET", "/health")
            return sock.recv(65536).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def test_sigterm_drains_refuses_kept_alive_requests_and_a_second_one_forces(
    tmp_path: Path,
) -> None:
    proc, port, log = _start(tmp_path)
    try:
        wait_until(lambda: _serving(port), timeout=180, interval=0.2)
        kept = socket.create_connection(("127.0.0.1", port), timeout=10)
        _send(kept, "GET", "/health")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        long = socket.create_connection(("127.0.0.1", port), timeout=10)
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "seed": 1}
        _send(long, "POST", "/v1/completions", json.dumps(body).encode())
        assert long.recv(65536).startswith(b"HTTP/1.1 200")  # streaming: in flight
        proc.send_signal(signal.SIGTERM)
        # the stop's own line, logged just before the drain begins (the signal's line, "SIGTERM:
        # stopping (...)", comes before the loop gets to it: a request then was still served)
        wait_until(lambda: re.search(rb": stopping$", log.read_bytes(), re.M), timeout=10)
        t0 = time.monotonic()
        _send(kept, "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}')
        answer = kept.recv(65536)
        assert time.monotonic() - t0 < 2, "the kept-alive request waited for the drain"
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 30" in answer, answer
        assert b"draining (stopping)" in answer and b"Connection: close" in answer
        assert proc.poll() is None  # still draining the long request
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
        text = log.read_text()
        assert "stop signal again: stopping now, 1 request(s) cancelled" in text
        assert "Traceback" not in text and " ERROR " not in text
        long.settimeout(5)
        rest = b""
        while chunk := long.recv(65536):
            rest += chunk
        assert b"the request was cancelled (the server is shutting down)" in rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_while_starting_stops_with_a_log_line(tmp_path: Path) -> None:
    # while it imports the engine, then while the model loads on its thread
    for when, said in (("importing", "SIGTERM while starting: stopped before serving"),
                       ("loading", "stopped while the model was loading")):  # fmt: skip
        proc, _, log = _start(tmp_path)
        try:
            if when == "importing":
                time.sleep(0.5)
            else:
                wait_until(lambda path=log: b"residency plan" in path.read_bytes(), timeout=120)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()  # not killed, not aborted
        finally:
            if proc.poll() is None:
                proc.kill()
        text = log.read_text()
        assert said in text and "Traceback" not in text, text


# an operator's chat template that takes hours to render (nested loops within the sandbox's
# range limit)
ENDLESS_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}{{ messages[0].content }}")  # fmt: skip


def test_a_second_sigterm_stops_at_once_while_a_template_renders(tmp_path: Path) -> None:
    """A request stuck in the chat template (on a worker thread, beyond any cancel): the second
    SIGTERM exits 0 at once, without waiting for the thread, and with no ERROR line."""
    template = tmp_path / "endless.jinja"
    template.write_text(ENDLESS_TEMPLATE)
    proc, port, log = _start(tmp_path, f'[model]\nchat_template = "{template}"\n')
    try:
        wait_until(lambda: _serving(port), timeout=180, interval=0.2)
        stuck = socket.create_connection(("127.0.0.1", port), timeout=10)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        _send(stuck, "POST", "/v1/chat/completions", json.dumps(body).encode())
        time.sleep(0.5)  # it renders
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: b"stopping" in log.read_bytes(), timeout=10)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 3  # not the 5 s backstop
        text = log.read_text()
        assert "stopped (forced)" in text and " ERROR " not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
