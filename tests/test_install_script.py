"""scripts/install.sh's own functions, sourced into bash: apt waits (bounded) for another apt's
lock, and the long pip steps say how far they are. apt-get and dpkg are stand-ins on PATH that
record how they were called (a test must not install packages on the machine it runs on)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install.sh"


def _bash(command: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"source {SCRIPT}; {command}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "VENV": str(tmp_path), **env},
    )  # fmt: skip


def test_apt_waits_for_the_dpkg_lock_with_a_bound(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "dpkg").write_text("#!/bin/sh\nexit 1\n")  # every package is missing
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    r = _bash("apt_install some-package", tmp_path, PATH=path, APT_LOCK_TIMEOUT="7")
    assert r.returncode == 0, r.stderr
    assert "waits up to 7s for the dpkg lock" in r.stdout
    update, install = calls.read_text().splitlines()
    assert update.startswith("-o DPkg::Lock::Timeout=7 update")
    assert install.startswith("-o DPkg::Lock::Timeout=7 install -y") and "some-package" in install


def test_a_long_step_reports_progress_and_its_failure(tmp_path: Path) -> None:
    r = _bash("long_step demo bash -c 'for i in 1 2 3; do echo step $i; sleep 1; done'",
              tmp_path, PROGRESS_EVERY="1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("install: demo (progress every 1s; full output in")
    assert any(line.startswith("install: demo: ") and ", step " in line for line in lines)
    assert lines[-1].startswith("install: demo done in")
    assert (tmp_path / "install-demo.log").read_text() == "step 1\nstep 2\nstep 3\n"
    r = _bash("long_step bad bash -c 'echo boom; exit 3'", tmp_path)
    assert r.returncode == 3 and "install: bad failed (exit 3)" in r.stderr and "boom" in r.stderr
