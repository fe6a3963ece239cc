"""The unit file, sysusers.d and tmpfiles.d snippets, checked by systemd's own tools.

`systemd-analyze verify` runs against a throw-away root that holds the system's unit
directory and stand-ins for the two executables the unit names (verify insists they exist);
it exits 0 even on unknown keys, so its output must also be empty. sysusers and tmpfiles
create the user and directories inside another throw-away root.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "stratad.service"
SYSUSERS = ROOT / "systemd" / "strata.sysusers.conf"
TMPFILES = ROOT / "systemd" / "strata.tmpfiles.conf"


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin")
    assert path, f"{name} is missing: scripts/install.sh --test installs the systemd package"
    return path


def _fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system/stratad.service")
    exec_paths = {line.split("=", 1)[1].split()[0] for line in UNIT.read_text().splitlines()
                  if line.startswith(("ExecStart=", "ExecStartPre="))}
    for p in exec_paths:
        stub = root / p.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    return root


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("systemd-analyze"), "verify", f"--root={root}",
         "/etc/systemd/system/stratad.service"],
        capture_output=True, text=True, timeout=60,
    )


def test_systemd_analyze_verify_passes_clean(tmp_path: Path) -> None:
    r = _verify(_fake_root(tmp_path))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


def test_verify_would_catch_a_typo(tmp_path: Path) -> None:
    root = _fake_root(tmp_path)
    unit = root / "etc/systemd/system/stratad.service"
    unit.write_text(unit.read_text().replace("LimitMEMLOCK=infinity", "LimitMEMLOK=infinity"))
    r = _verify(root)
    assert "Unknown key 'LimitMEMLOK'" in r.stderr


def _directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_unit_has_what_the_daemon_needs() -> None:
    d = _directives()
    assert d["Type"] == ["notify"] and d["WatchdogSec"] and d["NotifyAccess"] == ["main"]
    assert d["ExecStartPre"][0].endswith("stratactl check --config /etc/strata/stratad.toml")
    assert d["ExecStart"][0].endswith("stratad --config /etc/strata/stratad.toml")
    assert d["LimitMEMLOCK"] == ["infinity"]
    assert d["User"] == ["strata"] and d["Group"] == ["strata"]
    assert d["RuntimeDirectory"] == ["strata"] and d["StateDirectory"] == ["strata"]
    from stratad.__main__ import EXIT_BAD_MODEL
    from stratad.store.placement.admission import EXIT_SHORT_RAM

    # admission refused, a config error, a model that cannot be served: never restarted
    never = {str(EXIT_SHORT_RAM), "2", str(EXIT_BAD_MODEL)}
    assert never <= set(d["RestartPreventExitStatus"][0].split())
    assert "render" in d["SupplementaryGroups"][0]
    # hardening that would hide the GPU stays off
    for key in ("PrivateDevices", "PrivateUsers", "MemoryDenyWriteExecute", "DevicePolicy"):
        assert key not in d, key
    assert d["ProtectSystem"] == ["strict"] and d["NoNewPrivileges"] == ["yes"]


def test_socket_default_lives_in_the_runtime_directory() -> None:
    from stratad.config import Config

    assert Config().control.socket == "/run/strata/stratad.sock"


def test_sysusers_and_tmpfiles_in_a_fake_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    r = subprocess.run([_tool("systemd-sysusers"), f"--root={root}", str(SYSUSERS)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    passwd = (root / "etc/passwd").read_text()
    group = (root / "etc/group").read_text()
    assert passwd.startswith("strata:x:") and ":/var/lib/strata:" in passwd
    assert any(line.startswith("render:") and line.endswith("strata") for line in group.split())
    r = subprocess.run([_tool("systemd-tmpfiles"), f"--root={root}", "--create", str(TMPFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    uid = int(passwd.split(":")[2])
    for d in ("var/lib/strata", "var/lib/strata/tables", "etc/strata"):
        assert (root / d).is_dir(), d
    st = (root / "var/lib/strata").stat()
    assert st.st_uid == uid and oct(st.st_mode & 0o777) == oct(0o750)
