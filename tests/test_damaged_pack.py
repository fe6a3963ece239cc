"""A pack with one flipped byte in an expert blob, served on the reference path: the pinner
skips that resident copy, and the daemon says so instead of looking healthy: coverage counts
the expert as not covered (a WARNING, `stratactl coverage` exits 3) and /health says
"degraded" with the reason, in the same body as the control socket's status."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stratad.store.manifest import EXPERTS_NAME, read_manifest
from stratad.store.pack import write_pack
from tests.daemon import running_daemon
from tests.server_helpers import request, wait_until
from tests.test_store_fakes import tiny_moe_gguf


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    work = tmp_path_factory.mktemp("damaged-pack")
    pack = work / "tiny-moe.pack"
    write_pack(tiny_moe_gguf(tmp_path_factory), pack)
    blob = read_manifest(pack).blob(0, 3)
    with open(pack / EXPERTS_NAME, "r+b") as f:  # one byte of layer 0, expert 3 flipped
        f.seek(blob.offset + blob.nbytes // 2)
        b = f.read(1)
        f.seek(blob.offset + blob.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))
    config = work / "stratad.toml"
    config.write_text('[engine]\ndevice = "cpu"\nthreads = 1\nbackend = "reference"\n')
    log = work / "stratad.log"
    with running_daemon([str(pack), "--config", str(config)], log) as url:
        yield url, work / "stratad.sock", log


def _health(url: str) -> tuple[int, dict[str, Any]]:
    status, body = request(f"{url}/health")
    return status, json.loads(body)


def test_health_says_degraded_with_the_reason(daemon: tuple[str, Path, Path]) -> None:
    url, sock, _ = daemon
    wait_until(lambda: _health(url)[1]["status"] == "degraded", timeout=30, interval=0.1)
    status, body = _health(url)
    assert status == 200  # it serves, short of its plan
    assert "1 expert blob(s) failed their checksum (layer 0 expert 3)" in body["reason"]
    r = subprocess.run([sys.executable, "-m", "stratactl", "status", "--json", "--socket",
                        str(sock)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert json.loads(r.stdout)["health"] == body


def test_coverage_counts_the_expert_as_not_covered(daemon: tuple[str, Path, Path]) -> None:
    url, sock, log = daemon
    r = subprocess.run([sys.executable, "-m", "stratactl", "coverage", "--socket", str(sock)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 3, r.stdout + r.stderr
    assert "coverage: 31 of 32 experts keep a copy in RAM or VRAM" in r.stdout
    assert "failed their checksum (layer 0 expert 3)" in r.stdout
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "stratactl", "coverage", "--json", "--socket", str(sock)],
        capture_output=True, text=True, timeout=60).stdout)  # fmt: skip
    assert data["complete"] is False and data["layers"][0]["file_only"] == 1
    wait_until(lambda: "WARNING stratad: coverage: 1 expert blob(s)" in log.read_text(), 10)
