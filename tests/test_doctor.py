"""`stratactl doctor` without a daemon: every part present, exit 0, JSON that parses, the
environment and log parts read what is there. (With a daemon: tests/test_ops_daemon.py.)"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratactl import doctor as doctor_verb
from stratactl import logs
from stratad.store.placement.hostmem import read_bps

PARTS = {"host", "versions", "gpu", "tables", "memlock", "ram", "cpu_kernels", "daemon",
         "environment", "log"}


def doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "HIP_", "HSA_"))}
    env.update({"STRATA_LOG_LEVEL": "DEBUG", "STRATA_MODLE": "typo.gguf",
                "HIP_VISIBLE_DEVICES": "1", "HSA_OVERRIDE_GFX_VERSION": "11.0.0"})
    return subprocess.run([sys.executable, "-m", "stratactl", "doctor", "--socket",
                           str(tmp_path / "none.sock"), *args], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip


def write_log(tmp_path: Path) -> Path:
    log = tmp_path / "stratad.log"
    log.write_text(
        "2025-01-31 08:00:00,001 INFO stratad: serving\n"
        "2025-01-31 08:00:01,002 WARNING stratad.engine: no tuning table for sm90-cuda-13.0: x\n"
        "2025-01-31 08:00:02,003 ERROR stratad.server: request 7 failed\n"
        "  Traceback line\n"
        "2025-01-31 08:00:03,004 WARNING stratad.store: coverage: 3 of 4 experts\n")
    return log


def test_without_a_daemon_json(tmp_path: Path) -> None:
    r = doctor(tmp_path, "--json", "--log", str(write_log(tmp_path)), "--warnings", "2")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == PARTS
    assert not any("error" in part for part in report.values()), report
    assert report["versions"]["torch"] and report["versions"]["triton"]
    assert report["daemon"]["running"] is False and "no control socket" in (
        report["daemon"]["summary"])
    if not report["gpu"]["gpus"]:
        assert report["gpu"]["summary"] == "no GPU" and report["tables"]["reason"] == "no-gpu"
    assert report["memlock"]["summary"].startswith("soft ")
    assert report["ram"]["total_bytes"] > 0 and report["ram"]["read_gbs"] > 0.1
    env = report["environment"]
    assert env["strata"] == {"STRATA_LOG_LEVEL": "DEBUG", "STRATA_MODLE": "typo.gguf"}
    assert env["unknown_strata"] == ["STRATA_MODLE"]
    assert env["gpu_stack"]["HIP_VISIBLE_DEVICES"] == "1"
    assert env["gpu_stack"]["HSA_OVERRIDE_GFX_VERSION"] == "11.0.0"
    assert report["log"]["warnings"] == [
        "2025-01-31 08:00:02 ERROR stratad.server: request 7 failed\n  Traceback line",
        "2025-01-31 08:00:03 WARNING stratad.store: coverage: 3 of 4 experts"]


def test_without_a_daemon_human(tmp_path: Path) -> None:
    r = doctor(tmp_path, "--log", str(write_log(tmp_path)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for part in ("host", "versions", "gpu", "table", "memlock", "ram", "daemon", "env", "log"):
        assert any(line.startswith(f"{part} ") for line in lines), part
    assert "STRATA_LOG_LEVEL=DEBUG" in r.stdout and "HIP_VISIBLE_DEVICES=1" in r.stdout
    assert "not read by stratad (a typo?): STRATA_MODLE" in r.stdout
    assert "  2025-01-31 08:00:01 WARNING stratad.engine: no tuning table" in r.stdout
    assert "INFO stratad: serving" not in r.stdout


def test_without_a_journal_the_log_part_says_where_the_log_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host without a journal: a line under the log heading says so (not an empty part)."""
    monkeypatch.setattr(logs, "JOURNAL_DIRS", (tmp_path / "absent",))
    args = argparse.Namespace(log=None, unit="stratad.service", warnings=20)
    lines = doctor_verb.render({"log": doctor_verb._log(args)}).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("log "))
    assert lines[at] == "log       last WARNING lines"
    assert lines[at + 1].startswith("  no systemd journal on this host: stratad writes its log"
                                    " to its standard error"), lines  # fmt: skip
    assert lines[at + 1].endswith("pass that log with --log FILE")


def test_a_bad_value_is_reported_not_fatal(tmp_path: Path) -> None:
    env = {**os.environ, "STRATA_RESIDENT_HEADROOM_GIB": "lots"}
    r = subprocess.run([sys.executable, "-m", "stratactl", "doctor", "--json", "--socket",
                        str(tmp_path / "none.sock")], capture_output=True, text=True,
                       timeout=120, env=env)  # fmt: skip
    assert r.returncode == 0
    assert "STRATA_RESIDENT_HEADROOM_GIB='lots'" in json.loads(r.stdout)["environment"]["error"]


def test_read_bandwidth_is_a_rate() -> None:
    # GB/s, one thread and every core: a sum over 32 MiB (in cache here: only the unit is
    # checked; the host's figure comes from 1 GiB)
    for threads in (1, None):
        assert 0.1 < read_bps(32 << 20, passes=2, threads=threads) / 1e9 < 1000
