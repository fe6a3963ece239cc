"""What the cpu engine reports at start on a MoE GGUF whose experts all keep a RAM copy, pinned
slowly enough that the warm-up runs while pinning is under way: one log line names the
weights' types and the path that serves them, `stratactl coverage` names the model file the
experts are read from, and the lookups by tier count requests alone (the warm-up's experts,
found in the file before their RAM copies were pinned, are not requests' file lookups)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import running_daemon
from tests.server_helpers import Daemon, tiny_moe_path

# 1.8 MiB of experts at 1 MB/s: pinning lasts about two seconds, past the warm-up
CONFIG = """
[store]
pin_rate_gbps = 0.001
pin_chunk_mib = 1
[engine]
device = "cpu"
threads = 1
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("cpu-start")
    config = work / "stratad.toml"
    config.write_text(CONFIG)
    log = work / "stratad.log"
    with running_daemon([str(tiny_moe_path()), "--config", str(config)], log) as url:
        yield Daemon(url, log, None)


def _lookups(daemon: Daemon) -> dict[str, float]:
    got = daemon.metrics()
    return {t: got[f'strata:expert_lookups_total{{tier="{t}"}}'] for t in ("vram", "ram", "file")}


def test_the_warm_up_is_no_lookup(daemon: Daemon) -> None:
    [pinning] = [line for line in daemon.log.read_text().splitlines()
                 if "pinning the resident set: 32 experts" in line]  # fmt: skip
    # the RAM copies in the kernels' interleaved rows where they read them (interleaved_ram.py)
    assert pinning.endswith("; the copies interleaved in eights") == _interleaves()
    assert _lookups(daemon) == {"vram": 0, "ram": 0, "file": 0}
    r = daemon.client().completions.create(model="tiny-moe.gguf", prompt="Hello", max_tokens=2)
    assert r.choices[0].text is not None
    assert sum(_lookups(daemon).values()) > 0


def _interleaves() -> bool:
    """Whether this host's kernels read the interleaved layout (the daemon's default build)."""
    from kernels.cpu.experts import CpuExperts

    return CpuExperts(1).interleaves


def test_the_weights_line_names_types_and_path(daemon: Daemon) -> None:
    lines = [line for line in daemon.log.read_text().splitlines() if "stratad.engine: weights:"
             in line]  # fmt: skip
    assert len(lines) == 1, lines
    assert lines[0].split("stratad.engine: ", 1)[1] == (
        "weights: experts Q4_0 (12 stacks); the rest F32 (21 tensors), F16 (16), Q8_0 (2);"
        " GGUF blocks read by the CPU kernels (1 thread{rows}), every layer in one kernel call"
        " per step, the routed experts from the store's tiers"
    ).format(rows="; dense rows interleaved in eights" * _interleaves())


def test_coverage_names_the_model_file(daemon: Daemon) -> None:
    sock = daemon.log.parent / "stratad.sock"
    r = subprocess.run([sys.executable, "-m", "stratactl", "coverage", "--socket", str(sock)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    model: Path = tiny_moe_path()
    assert f"  complete: no routed expert is read from the model file {model}\n" in r.stdout
    assert "pack" not in r.stdout


def test_check_plans_what_the_daemon_runs(daemon: Daemon) -> None:
    """`stratactl check` sizes the RAM copies in the form the cpu engine makes them
    (interleaved where its kernels read that): the daemon's plan, hash for hash."""
    config = daemon.log.parent / "check.toml"
    config.write_text(f'[model]\npath = "{tiny_moe_path()}"\n{CONFIG}')
    r = subprocess.run([sys.executable, "-m", "stratactl", "check", "--json", "--config",
                        str(config)], capture_output=True, text=True, timeout=300)  # fmt: skip
    sock = daemon.log.parent / "stratad.sock"
    status = subprocess.run([sys.executable, "-m", "stratactl", "status", "--json", "--socket",
                             str(sock)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert json.loads(r.stdout)["plan"]["hash"] == json.loads(status.stdout)["plan_hash"] != ""
