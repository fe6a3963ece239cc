"""The control socket's access (peer credentials, the file mode, the group) and the CLI's
output on a MoE daemon whose coverage is short (exit code 3, the per-layer table, a degraded
plan), against canned answers (tests/control_fake.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratactl.__main__ import main as stratactl
from stratactl.client import Client
from stratad.protocol import StatusReply, StatusRequest
from tests.control_fake import ShortCoverage, as_nobody, serving


@pytest.fixture
def ctl() -> Iterator[tuple[Path, ShortCoverage]]:
    with serving() as s:
        yield s



# ---- access ------------------------------------------------------------------------------


def test_non_member_is_refused_by_peer_credentials() -> None:
    assert os.getuid() == 0, "this test switches uid: it runs as root (as CI does)"
    # mode 0666 lets anyone connect: the SO_PEERCRED check must refuse
    with serving(mode=0o666) as (path, _):
        kind, detail = as_nobody(path)
        assert kind == "error"
        assert "permission denied: uid 65534" in detail and "is not root" in detail
        assert Client(path).request(StatusRequest(), StatusReply).state == "serving"


def test_a_burst_of_refusals_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """Refused connects log one WARNING per refusal every few seconds, not one each."""
    assert os.getuid() == 0
    with caplog.at_level("WARNING", logger="stratad"), serving(mode=0o666) as (path, _):
        for _ in range(5):
            assert as_nobody(path)[0] == "error"
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]


def test_non_member_is_stopped_by_the_file_mode() -> None:
    assert os.getuid() == 0
    with serving(mode=0o660) as (path, _):
        kind, detail = as_nobody(path)
        assert kind == "client-error" and "permission denied on" in detail


def test_group_member_is_let_in() -> None:
    assert os.getuid() == 0
    with serving(mode=0o666, gid=65534) as (path, _):  # the socket's group: nogroup
        assert oct(path.stat().st_mode & 0o777) == oct(0o666) and path.stat().st_gid == 65534
        kind, _ = as_nobody(path)
        assert kind == "status"


# ---- the CLI's output on a MoE daemon whose coverage is short ---------------------------


def test_coverage_short_exits_3_with_the_table(
    ctl: tuple[Path, ShortCoverage], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = ctl
    assert stratactl(["coverage", "--socket", str(path)]) == 3
    out = capsys.readouterr().out
    assert "coverage: 11 of 16 experts keep a copy in RAM or VRAM (68.8%" in out
    assert ("INCOMPLETE: 5 experts are read from the pack file"
            " /var/lib/strata/a3b.pack/experts.bin when routed") in out
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
