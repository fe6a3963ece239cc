"""A real stratad on the default model, as systemd would run it: NOTIFY_SOCKET and a watchdog,
its control socket in a temp dir, and every stratactl verb against it (human and --json).

The tests run in file order on one daemon (module fixture); the last one stops it and checks
the whole notify sequence: STATUS progress, READY=1, WATCHDOG=1, STOPPING=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stratad.protocol import MAX_REQUEST_BYTES, StatusReply, StatusRequest, decode_reply
from tests.control_fake import as_nobody, raw
from tests.daemon import free_port, running_daemon


class NotifyListener:
    """A NOTIFY_SOCKET: a datagram socket whose messages are collected on a thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@dataclass
class Daemon:
    url: str
    socket: Path
    log: Path
    config: Path
    notify: NotifyListener
    stop: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("opsd")
    sockdir = Path(tempfile.mkdtemp(prefix="strata-opsd-"))
    sockdir.chmod(0o755)  # other uids must reach the socket for the peer-credential test
    config = work / "stratad.toml"
    # mode 0666: the file mode lets anyone connect, so the peer check is what refuses
    config.write_text('[control]\nmode = "0666"\n[engine]\ndevice = "cpu"\n')
    notify = NotifyListener(work / "notify.sock")
    d = Daemon("", sockdir / "stratad.sock", work / "stratad.log", config, notify)
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
    with d.stop:
        d.url = d.stop.enter_context(running_daemon(
            ["--config", str(config), "--control-socket", str(d.socket)], d.log, env))
        yield d
    notify.close()
    with contextlib.suppress(OSError):
        sockdir.rmdir()


def ctl(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratactl", *args, "--socket", str(d.socket)],
        capture_output=True, text=True, timeout=120,
    )


def test_status_human_and_json(daemon: Daemon) -> None:
    r = ctl(daemon, "status")
    assert r.returncode == 0, r.stderr
    assert "serving" in r.stdout and "SmolLM2-135M-Instruct.Q4_1.gguf (llama, dense) on cpu" in (
        r.stdout)
    assert "plan      dense   coverage complete" in r.stdout
    r = ctl(daemon, "status", "--json")
    data = json.loads(r.stdout)
    assert data["type"] == "status" and data["state"] == "serving" and data["pid"] > 0
    assert data["memory"]["rss_bytes"] > 50 << 20 and data["moe"] is False


def test_socket_mode_from_config(daemon: Daemon) -> None:
    assert oct(daemon.socket.stat().st_mode & 0o777) == oct(0o666)


def test_stats_count_a_real_request(daemon: Daemon) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{daemon.url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
    r = ctl(daemon, "stats")
    assert r.returncode == 0 and "requests 1, tokens" in r.stdout
    assert "prompt" in r.stdout and "generation" in r.stdout
    data = json.loads(ctl(daemon, "stats", "--json").stdout)
    assert data["requests"] == 1 and data["completion_tokens"] >= 1
    assert {s["name"] for s in data["stages"]} == {"prompt", "generation"}
    counts = data["counters"]  # the engine's: speculative decoding (on: the cpu engine)
    assert set(counts) == {"drafted", "accepted", "verifies", "preemptions"}
    assert 0 <= counts["accepted"] <= counts["drafted"] and counts["preemptions"] == 0


def test_coverage_and_plan_on_a_dense_model(daemon: Daemon) -> None:
    r = ctl(daemon, "coverage")
    assert r.returncode == 0 and "no routed experts (dense)" in r.stdout
    assert json.loads(ctl(daemon, "coverage", "--json").stdout)["complete"] is True
    r = ctl(daemon, "plan")
    assert r.returncode == 0 and r.stdout.startswith("plan dense:")
    assert json.loads(ctl(daemon, "plan", "--json").stdout) == json.loads(
        ctl(daemon, "plan", "--json").stdout)


def test_profile_save_refused_on_a_dense_model(daemon: Daemon) -> None:
    r = ctl(daemon, "profile-save", str(daemon.log.parent / "profile.json"))
    assert r.returncode == 1
    assert "the model has no routed experts: there is no expert profile" in r.stderr


def test_malformed_and_oversized_messages_leave_it_serving(daemon: Daemon) -> None:
    for line in (b"garbage\n", b'{"verb": "shutdown"}\n', b"\x00\xff\n",
                 b'{"verb": "status", "pad": "' + b"x" * (2 * MAX_REQUEST_BYTES) + b'"}\n'):
        reply = decode_reply(raw(daemon.socket, line))
        assert reply.__struct_config__.tag == "error"
    reply = decode_reply(raw(daemon.socket, b'{"verb": "status"}\n'))
    assert isinstance(reply, StatusReply) and reply.state == "serving"
    with urllib.request.urlopen(f"{daemon.url}/health", timeout=10) as resp:
        assert resp.status == 200


def test_non_member_peer_is_refused(daemon: Daemon) -> None:
    assert os.getuid() == 0, "switching uid needs root (CI runs as root)"
    kind, detail = as_nobody(daemon.socket)
    assert kind == "error" and "permission denied: uid 65534" in detail
    assert StatusRequest().v == 1


def test_logs_from_the_daemon_log_file(daemon: Daemon) -> None:
    r = subprocess.run([sys.executable, "-m", "stratactl", "logs", "warnings", "--file",
                        str(daemon.log)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "WARNING stratad.control: control socket: refused uid 65534" in r.stdout
    lines = subprocess.run([sys.executable, "-m", "stratactl", "logs", "--json", "--file",
                            str(daemon.log)], capture_output=True, text=True, timeout=60).stdout
    assert all(json.loads(line)["event"] for line in lines.splitlines())


def test_check_and_check_after_restart(daemon: Daemon) -> None:
    r = subprocess.run([sys.executable, "-m", "stratactl", "check", "--config",
                        str(daemon.config), "--after-restart", "--socket", str(daemon.socket)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok    model    SmolLM2-135M-Instruct.Q4_1.gguf: llama, 30 layers, dense" in r.stdout
    assert "ok    restart  the daemon serves a dense model" in r.stdout
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "stratactl", "check", "--json", "--config", str(daemon.config)],
        capture_output=True, text=True, timeout=120).stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert data["ok"] is True and checks["gpu"]["detail"] == "engine.device = cpu: no GPU needed"
    assert set(checks) >= {"config", "model", "plan", "memory", "memlock", "gpu", "tables",
                           "socket", "port"}


def test_a_second_daemon_on_the_socket_is_refused(daemon: Daemon) -> None:
    """Another stratad on the same control socket: `check` says a live daemon holds it (the
    running one's pid; the daemon itself after a restart), and the second daemon refuses to
    start instead of serving where stratactl cannot reach it. The first serves on."""
    pid = json.loads(ctl(daemon, "status", "--json").stdout)["pid"]
    config = daemon.log.parent / "second.toml"
    config.write_text(f'[control]\nsocket = "{daemon.socket}"\n[engine]\ndevice = "cpu"\n')

    def check(*extra: str) -> dict[str, str]:
        r = subprocess.run([sys.executable, "-m", "stratactl", "check", "--json", "--config",
                            str(config), *extra], capture_output=True, text=True, timeout=120)
        return next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "socket")

    held = check()
    assert held["status"] == "fail", held
    assert held["detail"].startswith(f"{daemon.socket}: held by a live daemon (pid {pid})")
    mine = check("--after-restart", "--socket", str(daemon.socket))
    assert mine == {"name": "socket", "status": "ok",
                    "detail": f"{daemon.socket}: the running daemon's (pid {pid})"}  # fmt: skip
    second = subprocess.run([sys.executable, "-m", "stratad", "--config", str(config),
                             "--port", str(free_port())], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert second.returncode == 1, second.stderr
    assert f"ERROR stratad: {daemon.socket}: another stratad is listening there (pid {pid})" in (
        second.stderr)
    assert "loaded" not in second.stderr  # refused before loading the model
    r = ctl(daemon, "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["pid"] == pid


def test_doctor_reads_the_running_daemon(daemon: Daemon) -> None:
    as_nobody(daemon.socket)  # a refused peer: a WARNING line in the daemon's log
    r = ctl(daemon, "doctor", "--json", "--log", str(daemon.log), "--warnings", "3")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    status = json.loads(ctl(daemon, "status", "--json").stdout)
    got = report["daemon"]
    assert got["running"] is True and got["state"] == "serving"
    assert got["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and got["device"] == "cpu"
    assert got["plan_hash"] == status["plan_hash"] != ""
    assert got["coverage"]["complete"] is True
    logged = subprocess.run([sys.executable, "-m", "stratactl", "logs", "warnings", "--file",
                             str(daemon.log)], capture_output=True, text=True, timeout=60)
    last = [line for line in logged.stdout.splitlines() if line[:4].isdigit()][-3:]
    assert [w.split("\n")[0] for w in report["log"]["warnings"]] == last
    assert "control socket: refused uid 65534" in last[-1]
    human = ctl(daemon, "doctor", "--log", str(daemon.log)).stdout
    assert f"daemon    serving, SmolLM2-135M-Instruct.Q4_1.gguf on cpu, plan {got['plan_hash']}" \
        ", coverage complete" in human


def test_drain_refuses_new_requests(daemon: Daemon) -> None:
    r = ctl(daemon, "drain", "--wait", "5")
    assert r.returncode == 0 and r.stdout.startswith("drained: no request in flight")
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode()
    req = urllib.request.Request(f"{daemon.url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 503 and info.value.headers["Retry-After"]
    status = json.loads(ctl(daemon, "status", "--json").stdout)
    assert status["state"] == "draining"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{daemon.url}/health", timeout=10)
    # one body: /health says what the control socket's status says
    assert info.value.code == 503 and json.loads(info.value.read()) == status["health"] == {
        "status": "draining", "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "running": 0,
        "waiting": 0, "reason": "stratactl drain"}
    assert json.loads(ctl(daemon, "drain", "--json").stdout) == {
        "type": "drain", "in_flight": 0, "drained": True}


def test_undrain_takes_requests_again(daemon: Daemon) -> None:
    r = ctl(daemon, "undrain")
    assert r.returncode == 0 and r.stdout.startswith("undrained"), r.stdout + r.stderr
    with urllib.request.urlopen(f"{daemon.url}/health", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{daemon.url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
    r = ctl(daemon, "undrain")  # not drained: nothing to undo
    assert r.returncode == 1 and "not undrained: the daemon is ok" in r.stderr
    data = json.loads(ctl(daemon, "status", "--json").stdout)
    assert data["state"] == "serving" and data["requests"]["refused"] >= 1


def test_notify_sequence_in_order(daemon: Daemon) -> None:
    daemon.stop.close()  # SIGTERM, and wait for the exit
    messages = daemon.notify.messages
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m)
    statuses = [m for m in messages[:ready] if m.startswith("STATUS=")]
    assert statuses[0] == "STATUS=loading the default model"
    assert "STATUS=SmolLM2-135M-Instruct.Q4_1.gguf loaded" in statuses
    assert "STATUS=serving SmolLM2-135M-Instruct.Q4_1.gguf on http://127.0.0.1:" in messages[ready]
    pings = [i for i, m in enumerate(messages) if m == "WATCHDOG=1"]
    assert pings and ready < pings[0] and pings[-1] < stopping
    assert len(pings) >= 3  # every 0.2 s for the module's duration
    assert messages[stopping] == "STOPPING=1\nSTATUS=stopping"
    assert not any("READY=1" in m for m in messages[stopping:])
    assert not daemon.socket.exists()  # the control socket is removed on the way out
    assert "Traceback" not in daemon.log.read_text()
