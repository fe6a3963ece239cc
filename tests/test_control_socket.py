"""The control socket with canned answers (tests/control_fake.py): wire format, bad input,
limits and concurrency. Access by peer credentials and the CLI's output on a MoE daemon whose
coverage is short are in tests/test_control_access.py; the real daemon drives the same server in
tests/test_ops_daemon.py.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratactl.__main__ import main as stratactl
from stratactl.client import Client, DaemonError
from stratad.control.server import ADMIT_WAIT_S, ControlError, ControlServer
from stratad.protocol import (
    MAX_REQUEST_BYTES,
    DrainReply,
    DrainRequest,
    ErrorReply,
    StatusReply,
    StatusRequest,
    decode_reply,
)
from tests.control_fake import ShortCoverage, as_nobody, raw, serving, socket_dir


@pytest.fixture
def ctl() -> Iterator[tuple[Path, ShortCoverage]]:
    with serving() as s:
        yield s


def test_socket_file_mode_and_cleanup() -> None:
    with serving(mode=0o660) as (path, _):
        st = path.stat()
        assert oct(st.st_mode & 0o777) == oct(0o660)
    assert not path.exists()  # removed on stop


def test_a_live_socket_is_not_taken_over(ctl: tuple[Path, ShortCoverage]) -> None:
    path, provider = ctl
    with pytest.raises(ControlError, match="another stratad is listening"):
        ControlServer(path, provider).start()


def test_a_stale_socket_is_replaced() -> None:
    d = socket_dir()
    path = d / "stratad.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    server = ControlServer(path, ShortCoverage())
    server.start()
    try:
        assert isinstance(Client(path).request(StatusRequest(), StatusReply), StatusReply)
    finally:
        server.stop()
        d.rmdir()


@pytest.mark.parametrize(
    ("line", "code", "words"),
    [
        (b"this is not json\n", "bad-request", "not JSON"),
        (b'{"verb": "reboot"}\n', "bad-request", "unknown verb; known: status, coverage"),
        (b'{"verb": "drain", "wait_s": "soon"}\n', "bad-request", "$.wait_s"),
        (b'{"verb": "status", "v": 99}\n', "bad-request", "protocol version 99"),
        (b'["status"]\n', "bad-request", "Expected `object`"),
        (b'{"verb": "status", "sudo": true}\n', "bad-request", "unknown field `sudo`"),
    ],
)
def test_malformed_requests_get_error_replies(
    ctl: tuple[Path, ShortCoverage], line: bytes, code: str, words: str
) -> None:
    path, _ = ctl
    reply = decode_reply(raw(path, line))
    assert isinstance(reply, ErrorReply) and reply.code == code and words in reply.error
    # and the server still answers
    assert Client(path).request(StatusRequest(), StatusReply).state == "serving"


def test_oversized_request_is_refused_and_the_server_lives(ctl: tuple[Path, ShortCoverage]) -> None:
    path, _ = ctl
    reply = decode_reply(raw(path, b'{"verb": "status", "pad": "' + b"x" * (MAX_REQUEST_BYTES * 4)))
    assert isinstance(reply, ErrorReply) and reply.code == "too-large"
    assert Client(path).request(StatusRequest(), StatusReply).model == "tiny-moe.gguf"


def test_many_requests_on_one_connection_and_garbage_bytes(
    ctl: tuple[Path, ShortCoverage],
) -> None:
    path, _ = ctl
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(b'{"verb":"status"}\n\n\xff\xfe\x00\n{"verb":"plan"}\n')
        data = b""
        while data.count(b"\n") < 3:
            data += s.recv(65536)
    kinds = [json.loads(line)["type"] for line in data.splitlines()]
    assert kinds == ["status", "error", "plan"]


def test_a_client_that_hangs_up_early_does_not_hurt(ctl: tuple[Path, ShortCoverage]) -> None:
    path, _ = ctl
    for _ in range(20):
        raw(path, b'{"verb": "coverage"}\n', read=False)
        raw(path, b'{"verb": "cov', read=False)
    assert Client(path).request(StatusRequest(), StatusReply).state == "serving"


def test_provider_errors_become_internal_error_replies(
    ctl: tuple[Path, ShortCoverage], caplog: pytest.LogCaptureFixture
) -> None:
    path, provider = ctl
    provider.fail_next = True
    with pytest.raises(DaemonError, match="status failed inside the daemon; its log") as info:
        Client(path).request(StatusRequest(), StatusReply)
    assert info.value.code == "internal"
    assert "provider bug" not in str(info.value) and "Error" not in str(info.value)
    assert "RuntimeError: provider bug" in caplog.text  # the details go to the log
    assert Client(path).request(StatusRequest(), StatusReply).state == "serving"


def test_idle_connections_close_and_one_peer_cannot_lock_others_out() -> None:
    assert os.getuid() == 0
    with serving(mode=0o666, gid=65534) as (path, _):
        held = []
        for _ in range(8):  # control.max_clients_per_peer for root
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            held.append(s)
        try:
            assert as_nobody(path)[0] == "status"  # another peer gets in
            # a ninth of root's closes its longest-idle one, and is answered
            assert Client(path).request(StatusRequest(), StatusReply).state == "serving"
            held[0].settimeout(1)
            assert held[0].recv(1) == b""
            held[1].settimeout(5)
            t0 = time.monotonic()
            assert held[1].recv(1) == b""  # closed by the daemon: idle for 1 s
            assert time.monotonic() - t0 < 3
        finally:
            for s in held:
                s.close()
        time.sleep(0.1)
        assert Client(path).request(StatusRequest(), StatusReply).state == "serving"


def test_waiting_drains_hold_no_worker_and_fill_the_peer_limit() -> None:
    assert os.getuid() == 0
    with serving(mode=0o666, gid=65534) as (path, provider):
        waits = [threading.Thread(target=lambda: Client(path, timeout_s=10).request(
            DrainRequest(wait_s=4.0), DrainReply)) for _ in range(8)]  # fmt: skip
        for t in waits:
            t.start()
        time.sleep(0.5)
        # root's 8 connections all wait in a drain, none idle: a ninth waits for a slot
        # (ADMIT_WAIT_S), then is refused
        t0 = time.monotonic()
        with pytest.raises(DaemonError, match="uid 0 holds 8 control connections"):
            Client(path).request(StatusRequest(), StatusReply)
        assert ADMIT_WAIT_S <= time.monotonic() - t0 < 3
        t0 = time.monotonic()
        assert as_nobody(path)[0] == "status"  # the 4 workers are not held by the drains
        assert time.monotonic() - t0 < 1.5
        for t in waits:
            t.join()
        assert provider.drains and set(provider.drains) == {0.0}


def test_unavailable_is_a_clear_error(
    ctl: tuple[Path, ShortCoverage], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = ctl
    assert stratactl(["profile-save", "--socket", str(path)]) == 1
    assert "store.expert_profile is not set" in capsys.readouterr().err


def test_concurrent_clients(ctl: tuple[Path, ShortCoverage]) -> None:
    path, _ = ctl
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            for _ in range(5):
                Client(path).request(StatusRequest(), StatusReply)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_a_connection_over_the_peer_limit_gets_the_first_slot_that_frees() -> None:
    with serving(mode=0o666, gid=65534) as (path, _):
        waits = [threading.Thread(target=lambda: Client(path, timeout_s=10).request(
            DrainRequest(wait_s=1.0), DrainReply)) for _ in range(8)]  # fmt: skip
        for t in waits:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()  # all 8 busy: the ninth waits for the first drain to end
        assert Client(path).request(StatusRequest(), StatusReply).state == "serving"
        assert time.monotonic() - t0 < ADMIT_WAIT_S
        for t in waits:
            t.join()
