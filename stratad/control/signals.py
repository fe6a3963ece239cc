"""SIGTERM and SIGINT over the daemon's whole life, from the first line of `main` on.

Before the HTTP loop runs (parsing the config, importing the engine, setting up), a signal is
only noted: `main` checks `requested` between steps and stops with one log line instead of
dying silently in the middle of an import. Once the loop runs, the first signal starts the
graceful stop (drain, then exit) and a second one forces it: requests in flight are cancelled,
and if the process has still not exited `FORCE_EXIT_S` later, it exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("stratad")

FORCE_EXIT_S = 5.0
EXIT_FORCED = 1  # the forced stop did not finish in FORCE_EXIT_S
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self) -> None:
        self.received: list[int] = []
        self._first: Callable[[], None] = lambda: None
        self._again: Callable[[], None] = lambda: None

    def install(self) -> StopSignals:
        """Note the signals from now on (call first thing in `main`)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)  # nothing more in a signal handler: `main` checks

    @property
    def requested(self) -> str | None:
        """The name of the first stop signal received, if any."""
        return signal.Signals(self.received[0]).name if self.received else None

    def attach(
        self, loop: asyncio.AbstractEventLoop, first: Callable[[], None],
        again: Callable[[], None],
    ) -> None:  # fmt: skip
        """From now on the loop takes the signals: `first` on the first one (at once, if one
        came before), `again` on any later one."""
        self._first, self._again = first, again
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_loop, sig)
        if self.received:
            first()

    def _on_loop(self, signum: int) -> None:
        self.received.append(signum)
        (self._first if len(self.received) == 1 else self._again)()


def exit_later(seconds: float = FORCE_EXIT_S) -> None:
    """A forced stop's backstop: exit at once if the process is still here after `seconds`."""

    def give_up() -> None:
        log.error("still not stopped %.0f s after the forced stop: exiting now", seconds)
        logging.shutdown()
        os._exit(EXIT_FORCED)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
