"""Container files, checked as far as a machine without a container engine allows: hadolint
on the Dockerfiles, their structure, shellcheck and a run of the entrypoint with stub commands
on PATH, and the LXC snippet's keys. Building and running the images needs Docker (and a GPU):
not done here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"
DOCKERFILES = sorted(CONTAINERS.glob("*.Dockerfile"))
ENTRYPOINT = CONTAINERS / "entrypoint.sh"


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is missing: scripts/install.sh --test installs it"
    return path


def test_both_images_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["cuda.Dockerfile", "rocm.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    r = subprocess.run([_tool("hadolint"), "--no-color", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    instructions = [line.split()[0] for line in text.splitlines()
                    if line and not line.startswith((" ", "#"))]
    base = re.search(r"^FROM (\S+)", text, re.M)
    assert base and base[1].split("/")[0] in {"rocm", "nvidia"}  # official vendor images
    # non-root from USER on; the entrypoint and healthcheck come after it
    assert instructions.index("USER") < instructions.index("ENTRYPOINT")
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*http://127\.0\.0\.1:8080/health", text, re.M)
    assert 'ENTRYPOINT ["/usr/local/bin/strata-entrypoint"]' in text
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    assert "scripts/install.sh" in text  # the project's own install, not a second recipe
    assert "--ulimit memlock=-1" in text and "-p 8080:8080" in text
    assert (CONTAINERS / f"{dockerfile.name}.dockerignore").is_file()


def test_container_config_parses() -> None:
    from stratad.config import parse_config

    config = parse_config((CONTAINERS / "stratad.container.toml").read_text())
    assert config.server.host == "0.0.0.0" and config.server.port == 8080
    assert config.control.socket == "/run/strata/stratad.sock"


def test_shellcheck_entrypoint() -> None:
    r = subprocess.run([_tool("shellcheck"), "--shell=sh", str(ENTRYPOINT)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


def _stubs(tmp_path: Path, tables_rc: int, check_rc: int) -> Path:
    """stratactl and stratad that log their arguments; stratad also logs its pid."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "stratactl").write_text(
        f'#!/bin/sh\necho "stratactl $*" >> {log}\n'
        f'case "$1" in tables) exit {tables_rc};; check) exit {check_rc};; esac\nexit 0\n')
    (bin_dir / "stratad").write_text(f'#!/bin/sh\necho "stratad $* pid=$$" >> {log}\nexit 7\n')
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    return bin_dir


def _entrypoint(tmp_path: Path, *args: str, tables_rc: int = 0,
                check_rc: int = 0) -> tuple[subprocess.CompletedProcess[str], list[str], int]:
    bin_dir = _stubs(tmp_path, tables_rc, check_rc)
    proc = subprocess.Popen(["/bin/sh", str(ENTRYPOINT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    out, err = proc.communicate(timeout=30)
    log = tmp_path / "calls"
    calls = log.read_text().splitlines() if log.exists() else []
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), calls, proc.pid


def test_entrypoint_selects_checks_then_execs_stratad(tmp_path: Path) -> None:
    r, calls, pid = _entrypoint(tmp_path, "--port", "9000")
    assert calls == ["stratactl tables select", "stratactl check",
                     f"stratad --port 9000 pid={pid}"]  # exec: stratad took the shell's pid
    assert r.returncode == 7  # stratad's own exit code, nothing after it


def test_entrypoint_goes_on_without_a_matching_table(tmp_path: Path) -> None:
    r, calls, _ = _entrypoint(tmp_path, tables_rc=3)
    assert calls[-1].startswith("stratad")
    assert "no tuning table matches this GPU stack" in r.stderr


def test_entrypoint_goes_on_when_the_stack_is_unknown(tmp_path: Path) -> None:
    r, calls, _ = _entrypoint(tmp_path, tables_rc=1)
    assert calls[-1].startswith("stratad") and "could not detect the GPU stack" in r.stderr


def test_entrypoint_stops_when_the_check_fails(tmp_path: Path) -> None:
    r, calls, _ = _entrypoint(tmp_path, check_rc=1)
    assert calls == ["stratactl tables select", "stratactl check"]
    assert r.returncode == 1 and "stratactl check failed (exit 1): not starting stratad" in r.stderr


def test_entrypoint_runs_other_commands_as_is(tmp_path: Path) -> None:
    r, calls, _ = _entrypoint(tmp_path, "stratactl", "status", "--json")
    assert calls == ["stratactl status --json"] and r.returncode == 0


def test_lxc_snippet_keys() -> None:
    known = {"lxc.cgroup2.devices.allow", "lxc.mount.entry", "lxc.prlimit.memlock",
             "lxc.mount.auto"}
    lines = [line for line in (CONTAINERS / "lxc/stratad-rocm.conf").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    pairs = [tuple(part.strip() for part in line.split("=", 1)) for line in lines]
    assert all(len(p) == 2 and p[0] in known for p in pairs), lines
    values = {k: [v for key, v in pairs if key == k] for k in known}
    assert "c 226:* rwm" in values["lxc.cgroup2.devices.allow"]  # /dev/dri
    assert any(v.startswith("/dev/kfd dev/kfd") for v in values["lxc.mount.entry"])
    assert values["lxc.prlimit.memlock"] == ["unlimited"]

