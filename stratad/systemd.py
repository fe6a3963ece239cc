"""systemd glue: the notify protocol (READY, STATUS, WATCHDOG, STOPPING) and journald fields.

Through systemd-python when it is installed, the plain datagram protocol otherwise (both send
the same `KEY=value` lines to $NOTIFY_SOCKET). Without $NOTIFY_SOCKET every call is a no-op,
so the daemon runs the same way by hand, in a container or under systemd.

The variables read here are systemd's protocol, not Strata's configuration; they are read once,
into `SystemdEnv`, and passed on.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("stratad.systemd")

# journald field that marks the key events, for `journalctl STRATA_EVENT=coverage` and
# `stratactl logs`; values: plan, coverage, pinning, ready, warning, stopping.
EVENT_FIELD = "STRATA_EVENT"


@dataclass(frozen=True)
class SystemdEnv:
    notify_socket: str | None = None
    """NOTIFY_SOCKET: where to send READY=1 and friends (Type=notify)."""
    watchdog_usec: int = 0
    """WATCHDOG_USEC: the unit's WatchdogSec; ping at half of it."""
    watchdog_pid: int | None = None
    """WATCHDOG_PID: the process the watchdog is meant for (absent: us)."""
    journal_stream: str | None = None
    """JOURNAL_STREAM: "dev:inode" of stderr when it is connected to the journal."""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> SystemdEnv:
        env = os.environ if environ is None else environ

        def num(name: str) -> int | None:
            try:
                return int(env[name])
            except (KeyError, ValueError):
                return None

        return cls(
            notify_socket=env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=num("WATCHDOG_USEC") or 0,
            watchdog_pid=num("WATCHDOG_PID"),
            journal_stream=env.get("JOURNAL_STREAM") or None,
        )

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping, or None when no watchdog is asked of this process."""
        if self.watchdog_usec <= 0:
            return None
        if self.watchdog_pid is not None and self.watchdog_pid != os.getpid():
            return None
        return self.watchdog_usec / 2e6


class Notifier:
    """Sends sd_notify messages; thread-safe; silent when not started by systemd."""

    def __init__(self, env: SystemdEnv, use_library: bool = True) -> None:
        self.env = env
        self.address = env.notify_socket
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._library: Any = None
        if self.address and use_library:
            with contextlib.suppress(ImportError):
                self._library = importlib.import_module("systemd.daemon")  # systemd-python

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> bool:
        if not self.address:
            return False
        message = "\n".join(lines)
        with self._lock:
            try:
                if self._library is not None:
                    return bool(self._library.notify(message))
                return self._send_datagram(message.encode())
            except OSError as e:
                log.debug("sd_notify %r failed: %s", message, e)
                return False

    def _send_datagram(self, data: bytes) -> bool:
        assert self.address is not None
        address = self.address
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.sendto(data, address)
        return True

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def ready(self, text: str) -> None:
        self.send("READY=1", f"STATUS={text}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, text: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={text}")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def journal_handler(env: SystemdEnv) -> logging.Handler | None:
    """A handler that writes to the journal with structured fields, when stderr goes there.

    Returns None outside the journal (or without systemd-python): keep the stream handler.
    `extra={EVENT_FIELD: "coverage", ...}` on a log call becomes journal fields.
    """
    if not env.journal_stream:
        return None
    try:
        st = os.fstat(2)
        dev, ino = (int(x) for x in env.journal_stream.split(":"))
    except (OSError, ValueError):
        return None
    if (st.st_dev, st.st_ino) != (dev, ino):
        return None
    try:
        journal = importlib.import_module("systemd.journal")  # systemd-python
    except ImportError:
        return None
    handler: logging.Handler = journal.JournalHandler(SYSLOG_IDENTIFIER="stratad")
    return handler


def event(name: str, **fields: object) -> dict[str, object]:
    """`extra=` for a log call that marks a key event in the journal."""
    extra: dict[str, object] = {EVENT_FIELD: name}
    extra.update({f"STRATA_{k.upper()}": v for k, v in fields.items()})
    return extra


def classify(logger: str, levelno: int, message: str) -> str | None:
    """The key event a log line is, if any: plan, coverage, timing or warning.

    Used for the journal's STRATA_EVENT field and by `stratactl logs` on plain log files."""
    text = message.lower()
    if "coverage" in text or re.search(r"\d+ of \d+ experts", text):
        return "coverage"
    if re.search(r"\bplan\b", text):
        return "plan"
    if "timing" in text:
        return "timing"
    if levelno >= logging.WARNING:
        return "warning"
    return None
