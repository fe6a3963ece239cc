"""The control socket with canned answers: wire format, bad input, access, and the CLI's output.

The real daemon drives the same server in tests/test_ops_daemon.py; here a provider with a MoE
model whose coverage is short shows what the dense default model cannot (exit code 3, the
per-layer table, a degraded plan).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratactl.__main__ import main as stratactl
from stratactl.client import Client, ClientError, DaemonError
from stratad.control.provider import Unavailable
from stratad.control.server import ControlError, ControlServer
from stratad.protocol import (
    MAX_REQUEST_BYTES,
    CoverageReply,
    DrainReply,
    DrainRequest,
    ErrorReply,
    LayerCoverage,
    PlanReply,
    ProfileSaveReply,
    StatsReply,
    StatusReply,
    StatusRequest,
    Tier,
    UndrainReply,
    decode_reply,
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
                                  routed_mass=0.6)])

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


@pytest.fixture
def ctl() -> Iterator[tuple[Path, ShortCoverage]]:
    with serving() as s:
        yield s


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
            assert _as_nobody(path)[0] == "status"  # another peer gets in
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
            DrainRequest(wait_s=2.0), DrainReply)) for _ in range(8)]  # fmt: skip
        for t in waits:
            t.start()
        time.sleep(0.5)
        # root's 8 connections all wait in a drain, none idle: a ninth is refused
        with pytest.raises(DaemonError, match="uid 0 holds 8 control connections"):
            Client(path).request(StatusRequest(), StatusReply)
        t0 = time.monotonic()
        assert _as_nobody(path)[0] == "status"  # the 4 workers are not held by the drains
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
    assert not errors


# ---- access ------------------------------------------------------------------------------


def _as_nobody(path: Path) -> tuple[str, str]:
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


def test_non_member_is_refused_by_peer_credentials() -> None:
    assert os.getuid() == 0, "this test switches uid: it runs as root (as CI does)"
    # mode 0666 lets anyone connect: the SO_PEERCRED check must refuse
    with serving(mode=0o666) as (path, _):
        kind, detail = _as_nobody(path)
        assert kind == "error"
        assert "permission denied: uid 65534" in detail and "is not root" in detail
        assert Client(path).request(StatusRequest(), StatusReply).state == "serving"


def test_non_member_is_stopped_by_the_file_mode() -> None:
    assert os.getuid() == 0
    with serving(mode=0o660) as (path, _):
        kind, detail = _as_nobody(path)
        assert kind == "client-error" and "permission denied on" in detail


def test_group_member_is_let_in() -> None:
    assert os.getuid() == 0
    with serving(mode=0o666, gid=65534) as (path, _):  # the socket's group: nogroup
        assert oct(path.stat().st_mode & 0o777) == oct(0o666) and path.stat().st_gid == 65534
        kind, _ = _as_nobody(path)
        assert kind == "status"


# ---- the CLI's output on a MoE daemon whose coverage is short ---------------------------


def test_coverage_short_exits_3_with_the_table(
    ctl: tuple[Path, ShortCoverage], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = ctl
    assert stratactl(["coverage", "--socket", str(path)]) == 3
    out = capsys.readouterr().out
    assert "coverage: 11 of 16 experts keep a copy in RAM or VRAM (68.8%" in out
    assert "INCOMPLETE: 5 experts are read from the pack file when routed" in out
    assert "expect up to 26% less prompt speed" in out
    assert "    1       8     0     3     5       60.0%" in out
    assert stratactl(["coverage", "--json", "--socket", str(path)]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["complete"] is False and data["layers"][1]["file_only"] == 5


def test_plan_status_stats_drain_human_and_json(
    ctl: tuple[Path, ShortCoverage], capsys: pytest.CaptureFixture[str]
) -> None:
    path, provider = ctl
    sock = ["--socket", str(path)]
    assert stratactl(["plan", *sock]) == 0
    out = capsys.readouterr().out
    assert "plan 0123456789ab (DEGRADED" in out and "ram        11 experts" in out
    assert stratactl(["status", *sock]) == 0
    assert "coverage INCOMPLETE (stratactl coverage)" in capsys.readouterr().out
    assert stratactl(["stats", *sock]) == 0
    assert "expert uses by tier: file 25.0%, ram 75.0%, vram 0.0%" in capsys.readouterr().out
    t0 = time.monotonic()
    assert stratactl(["drain", "--wait", "1.5", *sock]) == 3
    assert "1 request(s) still in flight" in capsys.readouterr().out
    assert 1.5 <= time.monotonic() - t0 < 3 and provider.drains[0] == 0.0
    for verb in ("plan", "status", "stats"):
        assert stratactl([verb, "--json", *sock]) == 0
        assert json.loads(capsys.readouterr().out)["type"] == verb


def test_no_daemon_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert stratactl(["status", "--socket", "/nonexistent/stratad.sock"]) == 1
    assert "no control socket at /nonexistent/stratad.sock: is stratad running?" in (
        capsys.readouterr().err)


def test_socket_found_through_the_environment(
    ctl: tuple[Path, ShortCoverage], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = ctl
    monkeypatch.setenv("STRATA_CONTROL_SOCKET", str(path))
    t0 = time.monotonic()
    assert stratactl(["status"]) == 0
    assert "tiny-moe.gguf" in capsys.readouterr().out
    assert time.monotonic() - t0 < 5
