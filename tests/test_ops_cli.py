"""stratactl itself: no torch on the socket verbs, `logs` on a file and on a real journal, and
`check` computing a MoE model's residency plan dry (with the store's own planning code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratactl import logs
from stratactl.__main__ import main as stratactl
from tests.control_fake import ShortCoverage, serving

JOURNAL_REMOTE = Path("/lib/systemd/systemd-journal-remote")


def test_stratactl_and_its_socket_verbs_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import stratactl.__main__ as m\n"
        "m.build_parser()\n"
        "import stratactl.daemon, stratactl.client, stratactl.logs, stratactl.tables\n"
        "import stratad.protocol, stratad.control.server, stratad.control.state\n"
        "try:\n    m.main(['status', '--socket', '/nonexistent'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(k for k in sys.modules\n"
        "               if k.split('.')[0] in ('torch', 'triton', 'numpy'))\n"
        "print(heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


LOG = """\
2026-01-05 10:00:00,001 INFO stratad.store: residency plan 0123456789ab: 12 experts start in VRAM
2026-01-05 10:00:01,002 WARNING stratad.store: coverage: 5093 of 6202 experts keep a copy in RAM
2026-01-05 10:00:02,003 INFO stratad.server: chat completion: 31 prompt + 5 completion tokens
2026-01-05 10:00:03,004 INFO stratad.engine: decode timing: 12.5 ms/step, hit rate 81%
2026-01-05 12:00:04,005 ERROR stratad.server: unhandled error in POST /v1/chat/completions
Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: boom
"""


def test_logs_topics_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "stratad.log"
    log.write_text(LOG)
    assert stratactl(["logs", "coverage", "--file", str(log)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "2026-01-05 10:00:01 WARNING stratad.store: coverage: 5093 of 6202 experts keep a copy"
        " in RAM"]
    assert stratactl(["logs", "warnings", "--file", str(log)]) == 0
    out = capsys.readouterr().out
    assert "coverage: 5093" in out and "ValueError: boom" in out and "plan" not in out
    assert stratactl(["logs", "plan", "timing", "--file", str(log)]) == 0
    assert [line.split()[3] for line in capsys.readouterr().out.splitlines()] == [
        "stratad.store:", "stratad.engine:"]
    assert stratactl(["logs", "--since", "2026-01-05 11:00", "--file", str(log), "--json"]) == 0
    assert [json.loads(line)["level"] for line in capsys.readouterr().out.splitlines()] == [40]
    assert stratactl(["logs", "nonsense", "--file", str(log)]) == 1


def test_logs_from_a_real_journal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert JOURNAL_REMOTE.exists(), "scripts/install.sh --test installs systemd-journal-remote"
    entries = [
        {"_SYSTEMD_UNIT": "stratad.service", "PRIORITY": "4", "STRATA_EVENT": "coverage",
         "MESSAGE": "coverage: 5 of 8 experts keep a copy in RAM or VRAM"},
        {"_SYSTEMD_UNIT": "stratad.service", "PRIORITY": "6", "STRATA_EVENT": "plan",
         "MESSAGE": "residency plan 0123456789ab"},
        {"_SYSTEMD_UNIT": "other.service", "PRIORITY": "3", "MESSAGE": "coverage of others"},
    ]
    export = ""
    for i, e in enumerate(entries):
        export += (f"__REALTIME_TIMESTAMP={1_700_000_000_000_000 + i * 1_000_000}\n"
                   f"__MONOTONIC_TIMESTAMP={i + 1}\n_BOOT_ID={'0' * 32}\n")
        export += "".join(f"{k}={v}\n" for k, v in e.items()) + "\n"
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    subprocess.run([str(JOURNAL_REMOTE), "-o", str(journal_dir / "remote.journal"), "-"],
                   input=export, text=True, check=True, capture_output=True, timeout=60)
    assert stratactl(["logs", "--journal-dir", str(journal_dir), "--json"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(g["event"], g["level"]) for g in got] == [("coverage", 30), ("plan", 20)]
    assert stratactl(["logs", "warnings", "--journal-dir", str(journal_dir)]) == 0
    assert capsys.readouterr().out.count("\n") == 1


def test_logs_without_a_journal_says_where_the_log_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host without a journal (a container, a laptop) is no error: the README's command says
    where the daemon's log goes and how to read it, and exits 0."""
    empty = tmp_path / "journal"
    empty.mkdir()
    monkeypatch.setattr(logs, "JOURNAL_DIRS", (empty, tmp_path / "absent"))
    assert stratactl(["logs", "coverage", "warnings", "--since", "1h"]) == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("no systemd journal on this host: stratad writes its log to its"
                              " standard error"), out.err  # fmt: skip
    assert "--file PATH" in out.err


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"
    assert stratactl(["synth", "tiny-moe", "-o", str(path)]) == 0
    return path


def _check(tmp_path: Path, model: Path, budget: str, *extra: str) -> tuple[int, dict]:
    config = tmp_path / "moe.toml"
    config.write_text(f'[model]\npath = "{model}"\n[engine]\ndevice = "cpu"\n'
                      f"[store]\nresident_budget_gib = {budget}\nresident_headroom_gib = 0.5\n")
    r = subprocess.run([sys.executable, "-m", "stratactl", "check", "--json", "--config",
                        str(config), *extra], capture_output=True, text=True, timeout=300)
    return r.returncode, json.loads(r.stdout)


def test_check_computes_the_moe_plan_dry(tiny_moe: Path, tmp_path: Path) -> None:
    rc, full = _check(tmp_path, tiny_moe, "1.0")
    checks = {c["name"]: c for c in full["checks"]}
    assert rc == 0 and checks["plan"]["status"] == "ok"
    assert "coverage 32 of 32, complete" in checks["plan"]["detail"]
    assert checks["model"]["detail"].startswith("tiny-moe.gguf: qwen3moe, 4 layers, MoE, 8")
    # a budget for about half the experts: the plan says so, and stays the same plan
    rc, short = _check(tmp_path, tiny_moe, "0.001")
    checks = {c["name"]: c for c in short["checks"]}
    assert rc == 0 and checks["plan"]["status"] == "warn"
    assert "INCOMPLETE" in checks["plan"]["detail"]
    assert short["plan"]["ram"]["experts"] < 32 and short["plan"]["moe"] is True
    again = _check(tmp_path, tiny_moe, "0.001")[1]
    assert again["plan"]["hash"] == short["plan"]["hash"] != full["plan"]["hash"]


def test_check_after_restart_says_when_the_start_landed_short(
    tiny_moe: Path, tmp_path: Path
) -> None:
    with serving() as (path, provider):  # a daemon whose plan is DEGRADED
        assert isinstance(provider, ShortCoverage)
        rc, out = _check(tmp_path, tiny_moe, "1.0", "--after-restart", "--socket", str(path))
    restart = next(c for c in out["checks"] if c["name"] == "restart")
    assert rc == 1 and restart["status"] == "fail"
    assert restart["detail"].startswith("landed SHORT: running plan 0123456789ab: coverage 11")


def test_check_fails_on_a_missing_model(tmp_path: Path) -> None:
    rc, out = _check(tmp_path, tmp_path / "missing.gguf", "1.0")
    model = next(c for c in out["checks"] if c["name"] == "model")
    assert rc == 1 and model["status"] == "fail" and "no such file" in model["detail"]


def test_check_fails_on_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[control]\nsocket_path = 'x'\n")
    assert stratactl(["check", "--config", str(config)]) == 1
    assert "fail  config" in capsys.readouterr().out
