"""A pack with one flipped byte in an expert blob, served on the reference path: the pinner
skips that resident copy, and the daemon says so instead of looking healthy: coverage counts
the expert as not covered (a WARNING, `stratactl coverage` exits 3) and /health says
"degraded" with the reason, in the same body as the control socket's status. Requests never
fail for it: the blob is read from the model file the pack was made from (named once, at
WARNING), and where that file is gone the daemon refuses to start, in one line, with exit 65."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stratad.__main__ import EXIT_BAD_MODEL
from stratad.config import load_config, override
from stratad.env import Env
from stratad.runtime.jobs import Job
from stratad.runtime.service import Engine
from stratad.store.pack.manifest import EXPERTS_NAME, read_manifest
from stratad.store.pack.write import write_pack
from stratad.store.tiers.original import open_original, repair_source
from stratad.store.tiers.sources import PackExperts
from tests.daemon import free_port, running_daemon
from tests.server_helpers import request, wait_until
from tests.test_store_fakes import tiny_moe_gguf

CONFIG = '[engine]\ndevice = "cpu"\nthreads = 1\nbackend = "reference"\n'
PROMPT = "The quick brown fox jumps over the lazy dog, " * 6
REPAIRED = "the blob of layer 0, expert 3 fails its checksum in the pack; it is read from the model"


def _flip_a_byte(pack: Path, layer: int, expert: int) -> None:
    blob = read_manifest(pack).blob(layer, expert)
    with open(pack / EXPERTS_NAME, "r+b") as f:
        f.seek(blob.offset + blob.nbytes // 2)
        b = f.read(1)
        f.seek(blob.offset + blob.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    work = tmp_path_factory.mktemp("damaged-pack")
    pack = work / "tiny-moe.pack"
    write_pack(tiny_moe_gguf(tmp_path_factory), pack)  # the original stays where it was
    _flip_a_byte(pack, 0, 3)
    config = work / "stratad.toml"
    config.write_text(CONFIG)
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


def _complete(url: str) -> tuple[int, dict[str, Any]]:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}  # no model: the served one
    status, raw = request(f"{url}/v1/completions", json.dumps(body).encode())
    return status, json.loads(raw)


def test_requests_get_the_references_tokens_from_the_original(
    daemon: tuple[str, Path, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    url, _, log = daemon
    config = tmp_path / "stratad.toml"
    config.write_text(CONFIG)
    gguf = str(tiny_moe_gguf(tmp_path_factory))  # the original itself, in this process
    reference = Engine(override(load_config(config, Env.read()), "model", path=gguf))
    want = "".join(d.text for d in reference.run(Job(prompt=PROMPT, max_tokens=12, temperature=0)))
    for _ in range(2):
        status, body = _complete(url)
        assert status == 200, body
        assert body["choices"][0]["text"] == want
    # the damaged expert was routed to, and named once
    assert log.read_text().count(REPAIRED) == 1, log.read_text()
    assert "Traceback" not in log.read_text()


def test_without_the_original_the_start_is_refused_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    original = tmp_path / "tiny-moe.gguf"
    shutil.copyfile(tiny_moe_gguf(tmp_path_factory), original)
    pack = tmp_path / "tiny-moe.pack"
    write_pack(original, pack)
    original.unlink()
    _flip_a_byte(pack, 0, 3)
    config = tmp_path / "stratad.toml"
    config.write_text(CONFIG)
    r = subprocess.run(
        [sys.executable, "-m", "stratad", str(pack), "--config", str(config), "--port",
         str(free_port()), "--control-socket", str(tmp_path / "ctl.sock")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == EXIT_BAD_MODEL == 65, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, r.stderr
    assert "1 expert blob(s) fail their checksum (layer 0 expert 3)" in errors[0]
    assert f"{original}: No such file or directory" in errors[0]
    assert "Traceback" not in r.stderr


def test_an_original_stands_in_only_at_its_recorded_size(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    gguf = tiny_moe_gguf(tmp_path_factory)
    manifest = write_pack(gguf, tmp_path / "tiny-moe.pack")
    assert manifest.source == str(gguf.absolute()) and manifest.source_nbytes == gguf.stat().st_size
    assert open_original(manifest)[0] is not None
    resized = msgspec.structs.replace(manifest, source_nbytes=manifest.source_nbytes + 1)
    assert open_original(resized) == (
        None, f"{gguf}: {gguf.stat().st_size:,} bytes, the pack was made from"
        f" {manifest.source_nbytes + 1:,}"
    )  # fmt: skip
    older = msgspec.structs.replace(manifest, source_nbytes=0)
    assert "does not record its size" in open_original(older)[1]


def test_a_healthy_pack_is_not_called_damaged(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With its model file there, a healthy pack's start says what would stand in for a blob
    that fails, not that one is damaged (a damaged one is named, at WARNING, when it is read)."""
    gguf = tiny_moe_gguf(tmp_path_factory)
    write_pack(gguf, tmp_path / "tiny-moe.pack")
    with caplog.at_level(logging.INFO, logger="stratad.store"):
        original = repair_source(PackExperts(tmp_path / "tiny-moe.pack"))
    assert original is not None and not original.damaged
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "each expert blob's checksum is checked when it is first read; should one fail, the"
        f" model file the pack was made from ({gguf.absolute()}) stands in for it"
    ]
