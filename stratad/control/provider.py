"""What the control socket asks of the daemon: one method per verb, each returning its reply.

The socket server (`stratad.control.server`) only decodes, checks access and dispatches; the
daemon fills this interface in (`stratad.control.state.DaemonState`), and tests may fill it with
canned replies. Methods run on a worker thread of the control server, never on the engine's.
"""

from __future__ import annotations

from typing import Protocol

from stratad.protocol import (
    CoverageReply,
    DrainReply,
    PlanReply,
    ProfileSaveReply,
    StatsReply,
    StatusReply,
    UndrainReply,
)


class Unavailable(RuntimeError):
    """The answer does not exist yet or here (e.g. coverage while the model loads)."""


class Provider(Protocol):
    def status(self) -> StatusReply: ...

    def coverage(self) -> CoverageReply: ...

    def plan(self) -> PlanReply: ...

    def stats(self) -> StatsReply: ...

    def save_profile(self, path: str) -> ProfileSaveReply: ...

    def drain(self, wait_s: float) -> DrainReply: ...

    def undrain(self) -> UndrainReply: ...
