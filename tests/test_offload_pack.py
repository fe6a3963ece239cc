"""The offload engine reading a pack: its RAM tier and file reads go through the store's
source, so every blob's checksum is verified on the GPU path too, and a damaged blob is
named (at start for a RAM copy, on first read for one only the file holds); the daemon
refuses such a start in one line with the exit code its unit never restarts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.tuning.configs import INTERPRETED, KernelConfigs
from stratad.__main__ import EXIT_BAD_MODEL
from stratad.engine.offload.experts import blob_layouts, kernel_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.kernel_form import KernelForm
from stratad.engine.passes import FUSED_MAX_TOKENS
from stratad.engine.reference.forward import ReferenceForward
from stratad.store.addressed import AddressedStore
from stratad.store.pack.manifest import EXPERTS_NAME, read_manifest
from stratad.store.pack.packed import load_pack
from stratad.store.pack.write import write_pack
from stratad.store.tiers.rows import PinnedRows, gpu_lock
from stratad.store.tiers.sources import BlobCorrupt, PackExperts
from tests.daemon import free_port
from tests.test_store_fakes import tiny_moe_gguf

# a staged chunk (every expert of a layer), then 2 through the fused kernels
CHUNK = FUSED_MAX_TOKENS + 1
PROMPT = list(range(100, 100 + CHUNK + 2))


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("offload-pack") / "tiny-moe.pack"
    write_pack(tiny_moe_gguf(tmp_path_factory), out)
    return out


def _damaged(pack: Path, tmp_path: Path, layer: int, expert: int) -> Path:
    """A copy of the pack with one byte of blob (layer, expert) flipped."""
    copy = tmp_path / "damaged.pack"
    shutil.copytree(pack, copy)
    blob = read_manifest(copy).blob(layer, expert)
    with open(copy / EXPERTS_NAME, "r+b") as f:
        f.seek(blob.offset + blob.nbytes // 2)
        b = f.read(1)
        f.seek(blob.offset + blob.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))
    return copy


def _engine(pack: Path, device: str, ram: list[list[int]] | None) -> OffloadForward:
    model, _ = load_pack(pack)
    source = PackExperts(pack)
    form = KernelForm(source.layouts, kernel_layouts(model))
    store = AddressedStore(PinnedRows(source, form, ram, gpu_lock(torch.device(device))))
    budget = 3 * model.spec.n_layers * blob_layouts(model).slot_bytes
    kernels = INTERPRETED if device == "cpu" else KernelConfigs()
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                        kernels=kernels, graphs=False)  # fmt: skip
    # the slots start with experts 0-2 of each layer: the damaged expert 5 is not among them
    return OffloadForward(model, torch.device(device), cfg, store=store)


def _greedy(engine: OffloadForward | ReferenceForward, n: int) -> list[int]:
    cache = engine.new_cache(128)
    logits, out = engine(PROMPT, cache)[-1], []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine([out[-1]], cache)[-1]
    return out


def _no_copy_of(layer: int, expert: int, n_layers: int, n_experts: int) -> list[list[int]]:
    return [[x for x in range(n_experts) if (i, x) != (layer, expert)] for i in range(n_layers)]


def _checks(pack: Path, tmp_path: Path, device: str) -> None:
    model, _ = load_pack(pack)
    spec = model.spec
    assert _greedy(_engine(pack, device, None), 3) == _greedy(ReferenceForward(model), 3)
    damaged = _damaged(pack, tmp_path, 1, 5)
    with pytest.raises(BlobCorrupt, match="layer 1, expert 5 .* fails its checksum"):
        _engine(damaged, device, None)  # its RAM copy is read at start
    engine = _engine(damaged, device, _no_copy_of(1, 5, spec.n_layers, spec.n_experts))
    with pytest.raises(BlobCorrupt, match="layer 1, expert 5"):
        _greedy(engine, 1)  # the prompt's staged chunk reads it from the file


def test_pack_checksums_on_the_offload_path_cpu(pack: Path, tmp_path: Path) -> None:
    _checks(pack, tmp_path, "cpu")


@pytest.mark.gpu
def test_pack_checksums_on_the_offload_path_gpu(pack: Path, tmp_path: Path) -> None:
    _checks(pack, tmp_path, "cuda")


def test_daemon_refuses_a_damaged_pack_in_one_line(pack: Path, tmp_path: Path) -> None:
    damaged = _damaged(pack, tmp_path, 0, 3)
    config = tmp_path / "stratad.toml"
    config.write_text('[engine]\nbackend = "offload"\ndevice = "cpu"\n')
    r = subprocess.run(
        [sys.executable, "-m", "stratad", str(damaged), "--config", str(config), "--port",
         str(free_port()), "--control-socket", str(tmp_path / "ctl.sock")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert r.returncode == EXIT_BAD_MODEL, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "layer 0, expert 3" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
