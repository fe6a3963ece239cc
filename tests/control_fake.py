"""A control server with canned answers (a MoE daemon whose coverage is short), for the control
socket's tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from stratactl.client import Client, ClientError
from stratad.control.provider import Unavailable
from stratad.control.server import ControlServer
from stratad.protocol import (
    CoverageReply,
    DrainReply,
    LayerCoverage,
    PlanReply,
    ProfileSaveReply,
    StatsReply,
    StatusReply,
    StatusRequest,
    Tier,
    UndrainReply,
    encode,
)

GiB = 1 << 30


class ShortCoverage:
    """A MoE daemon whose start landed short: 5 of 8 experts of layer 1 are file-only."""

    def __init__(self) -> None:
        self.drains: list[float] = []
        self.fail_next = False

    def status(self) -> StatusReply:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("provider bug")
        return StatusReply(state="serving", version="0.1.0", pid=os.getpid(), uptime_s=12.0,
                           model="tiny-moe.gguf", arch="qwen3moe", device="cpu", moe=True,
                           plan_hash="0123456789ab", coverage_complete=False)

    def coverage(self) -> CoverageReply:
        return CoverageReply(
            moe=True, experts=16, in_vram=0, in_ram=11, in_file_only=5, routed_mass=0.8,
            complete=False, file_reads=40, file_read_bytes=40 * 57344,
            estimated_cost="5 experts (0.00 GiB) are read from the file when routed; expect up"
                           " to 26% less prompt speed on long prompts",
            estimated_slowdown=0.26,
            layers=[LayerCoverage(layer=0, experts=8, in_vram=0, in_ram=8, file_only=0,
                                  routed_mass=1.0),
                    LayerCoverage(layer=1, experts=8, in_vram=0, in_ram=3, file_only=5,
                                  routed_mass=0.6)],
            file="the pack file /var/lib/strata/a3b.pack/experts.bin")

    def plan(self) -> PlanReply:
        return PlanReply(hash="0123456789ab", moe=True, ram=Tier(experts=11, bytes=11 * 57344),
                         file=Tier(experts=5, bytes=5 * 57344), ram_budget_bytes=GiB,
                         degraded=True, inputs={"profile": "(none: uniform)"})

    def stats(self) -> StatsReply:
        return StatsReply(requests=3, prompt_tokens=90, completion_tokens=30,
                          tier_hits={"vram": 0, "ram": 30, "file": 10})

    def save_profile(self, path: str) -> ProfileSaveReply:
        if not path:
            raise Unavailable("no path given and store.expert_profile is not set")
        Path(path).write_text("{}")
        return ProfileSaveReply(path=path, experts=16, bytes=2)

    def drain(self, wait_s: float) -> DrainReply:
        self.drains.append(wait_s)
        return DrainReply(in_flight=1, drained=False)

    def undrain(self) -> UndrainReply:
        return UndrainReply(serving=False, state="draining")


def socket_dir() -> Path:
    """A directory any uid can traverse (pytest's own temp dirs are 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="strata-ctl-"))
    d.chmod(0o755)
    return d


@contextlib.contextmanager
def serving(mode: int = 0o660, gid: int | None = None) -> Iterator[tuple[Path, ShortCoverage]]:
    provider = ShortCoverage()
    path = socket_dir() / "stratad.sock"
    server = ControlServer(path, provider, mode=mode, gid=gid, idle_timeout_s=1,
                           max_clients_per_peer=8)  # fmt: skip
    server.start()
    try:
        yield path, provider
    finally:
        server.stop()
        path.parent.rmdir()


def raw(path: Path, data: bytes, read: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)  # the server may answer and close before reading it all
        if not read:
            return b""
        out = b""
        while not out.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def as_nobody(path: Path) -> tuple[str, str]:
    """Connect from a forked child running as nobody:nogroup; (kind, detail) of what happened."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                reply = Client(path, timeout_s=5).exchange(encode(StatusRequest()))
                kind = str(reply.__struct_config__.tag)
                result = {"kind": kind, "detail": getattr(reply, "error", "")}
            except ClientError as e:
                result = {"kind": "client-error", "detail": str(e)}
            os.write(w, json.dumps(result).encode())
        except BaseException as e:  # pragma: no cover - reported to the parent
            os.write(w, json.dumps({"kind": "crash", "detail": repr(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out["kind"], out["detail"]
