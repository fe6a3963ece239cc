"""sd_notify without a daemon around it: the plain datagram protocol, systemd-python's, and the
pinning progress that the store reports turning into STATUS= lines (real sockets throughout)."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratad.config import Config
from stratad.control.lifecycle import Operations
from stratad.systemd import Notifier, SystemdEnv, classify, event


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    d = Path(tempfile.mkdtemp(prefix="strata-notify-"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(d / "notify"))
    sock.settimeout(2)
    yield str(d / "notify"), sock
    sock.close()
    (d / "notify").unlink()
    d.rmdir()


def received(sock: socket.socket) -> list[str]:
    out = []
    sock.settimeout(0.2)
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            return out


def test_systemd_python_is_installed() -> None:
    # declared in the `systemd` extra that scripts/install.sh installs: notify goes through it
    import importlib

    assert callable(importlib.import_module("systemd.daemon").notify)


@pytest.mark.parametrize("use_library", [False, True], ids=["datagram", "systemd-python"])
def test_messages_arrive(listener: tuple[str, socket.socket], use_library: bool,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)  # systemd-python reads the process environment
    n = Notifier(SystemdEnv.read({"NOTIFY_SOCKET": path}), use_library=use_library)
    assert (n._library is not None) == use_library
    n.status("loading x")
    n.ready("serving x")
    n.watchdog()
    n.stopping()
    n.close()
    assert received(sock) == ["STATUS=loading x", "READY=1\nSTATUS=serving x", "WATCHDOG=1",
                              "STOPPING=1\nSTATUS=stopping"]


def test_abstract_namespace_address() -> None:
    name = f"strata-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        n = Notifier(SystemdEnv(notify_socket="@" + name), use_library=False)
        n.ready("up")
        assert received(sock) == ["READY=1\nSTATUS=up"]
    finally:
        sock.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier(SystemdEnv.read({}))
    assert not n.enabled and n.send("READY=1") is False


def test_watchdog_interval() -> None:
    assert SystemdEnv.read({}).watchdog_interval_s is None
    assert SystemdEnv.read({"WATCHDOG_USEC": "60000000"}).watchdog_interval_s == 30.0
    other = SystemdEnv.read({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval_s is None  # meant for another process


def test_pinning_progress_becomes_status_lines(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    ops = Operations(Config(), SystemdEnv(notify_socket=path))
    ops.notifier = Notifier(ops.sd_env, use_library=False)
    gib = 1 << 30
    ops.pinning_progress(0, 8 * gib, 0.0)
    ops._last_status = 0.0  # the STATUS= lines are throttled to one a second
    ops.pinning_progress(2 * gib, 8 * gib, 1.0 * gib)
    ops.pinning_progress(3 * gib, 8 * gib, 1.0 * gib)  # within the second: no line
    assert ops.state.state == "pinning" and ops.state.pinning is not None
    assert ops.state.pinning.eta_s == 5.0
    ops.pinning_progress(8 * gib, 8 * gib, 1.0 * gib)
    assert received(sock) == [
        "STATUS=pinning experts: 0.0 of 8.0 GiB (0%)",
        "STATUS=pinning experts: 2.0 of 8.0 GiB (25%), ETA 6 s",
        "STATUS=pinning experts: 8.0 of 8.0 GiB (100%)",
    ]
    status = ops.state.status()
    assert status.pinning is not None and status.pinning.fraction == 1.0


def test_pinning_done_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """The store's callback and the watcher thread both report the end: one log line."""
    ops = Operations(Config(), SystemdEnv())
    with caplog.at_level(logging.INFO, logger="stratad"):
        ops.pinning_progress(1 << 30, 1 << 30)
        ops.pinning_progress(1 << 30, 1 << 30)
    assert [r.getMessage() for r in caplog.records].count("pinning done: 1.00 GiB page-locked") == 1


def test_key_events_are_classified() -> None:
    assert classify("stratad.store", 30, "coverage: 5 of 8 experts keep a copy") == "coverage"
    assert classify("stratad.store", 20, "residency plan 0123: 3 experts") == "plan"
    assert classify("stratad.engine", 20, "decode timing: 12 ms/step") == "timing"
    assert classify("stratad.server", 30, "refused a request") == "warning"
    assert classify("stratad.server", 20, "chat completion: 31 tokens") is None
    assert event("coverage", plan_hash="ab") == {"STRATA_EVENT": "coverage",
                                                 "STRATA_PLAN_HASH": "ab"}
