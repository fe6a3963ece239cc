"""The pack: conversion from GGUF and safetensors, the format's checks, the file tier."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import pytest
import torch

from stratactl import pack as pack_cli
from stratad.model.spec import ExpertUnit, Model
from stratad.store.loader import load_model
from stratad.store.pack.manifest import (
    BLOB_ALIGN,
    EXPERTS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    PackError,
    read_manifest,
)
from stratad.store.pack.packed import load_pack
from stratad.store.pack.write import write_pack
from stratad.store.tiers.lock import LockChoice, NoLocker
from stratad.store.tiers.memory import ResidentRAM
from stratad.store.tiers.pinning import Pinner, PinSettings
from stratad.store.tiers.sources import BlobCorrupt, ModelExperts, PackExperts
from tests.test_store_fakes import tiny_hf_moe, tiny_moe_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe_gguf(tmp_path_factory)


@pytest.fixture(scope="module")
def gguf_model(gguf: Path) -> Model:
    return load_model(gguf)


@pytest.fixture(scope="module")
def packed(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("pack") / "tiny-moe.pack"
    return out, write_pack(gguf, out)


def _same_model(a: Model, b: Model) -> None:
    assert a.spec == b.spec
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.qtype, t.shape) == (u.qtype, u.shape), name
        assert torch.equal(t.dequantize(), u.dequantize()), name


def test_gguf_pack_round_trip(packed: tuple[Path, Manifest], gguf_model: Model) -> None:
    out, manifest = packed
    spec = gguf_model.spec
    assert manifest.format_version == FORMAT_VERSION
    assert len(manifest.blobs) == spec.n_layers * spec.n_experts == 32
    assert all(b.offset % BLOB_ALIGN == 0 for b in manifest.blobs)
    assert manifest.layouts[0].gate.qtype == "Q4_0"
    assert (out / EXPERTS_NAME).stat().st_size == manifest.experts_nbytes
    assert not out.with_name(out.name + ".partial").exists()
    raw = (out / EXPERTS_NAME).read_bytes()
    for blob in manifest.blobs:
        assert zlib.crc32(raw[blob.offset : blob.offset + blob.nbytes]) == blob.crc32
    model, again = load_pack(out)
    assert again == read_manifest(out)
    _same_model(gguf_model, model)
    # The file tier reads the same bytes from the pack as from the GGUF read in place.
    in_place, from_pack = ModelExperts(gguf_model), PackExperts(out)
    a = torch.empty(manifest.layouts[0].stride, dtype=torch.uint8)
    b = torch.empty_like(a)
    for layer, expert in ((0, 0), (3, 7), (2, 5)):
        in_place.read_into(layer, expert, a)
        from_pack.read_into(layer, expert, b)
        n = manifest.layouts[layer].nbytes
        assert torch.equal(a[:n], b[:n])
    assert from_pack.stats.snapshot().reads == 3
    assert from_pack.stats.snapshot().bytes == 3 * manifest.layouts[0].nbytes
    from_pack.close()


def test_safetensors_pack_round_trip(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    src = tiny_hf_moe(tmp_path_factory)
    manifest = write_pack(src, tmp_path / "hf.pack")
    assert manifest.source_format == "hf"
    assert manifest.layouts[0].down.qtype == "F32"
    assert (tmp_path / "hf.pack" / "config.json").is_file()  # the tokenizer's side files travel
    model, _ = load_pack(tmp_path / "hf.pack")
    _same_model(load_model(src), model)


def test_corrupted_blob_is_detected_and_named(
    packed: tuple[Path, Manifest], tmp_path: Path
) -> None:
    src, manifest = packed
    broken = tmp_path / "broken.pack"
    shutil.copytree(src, broken)
    blob = manifest.blob(2, 5)
    with open(broken / EXPERTS_NAME, "r+b") as f:
        f.seek(blob.offset + 1000)
        byte = f.read(1)
        f.seek(blob.offset + 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    source = PackExperts(broken)
    buf = torch.empty(manifest.layouts[2].stride, dtype=torch.uint8)
    source.read_into(2, 4, buf)  # its neighbours are fine
    source.read_into(3, 5, buf)
    for _ in range(2):  # and a damaged blob stays damaged: it is never marked verified
        with pytest.raises(BlobCorrupt) as err:
            source.read_into(2, 5, buf)
        assert (err.value.layer, err.value.expert) == (2, 5)
        assert "the blob of layer 2, expert 5" in str(err.value)
        assert f"offset {blob.offset:,}" in str(err.value)
        assert "fails its checksum" in str(err.value) and "stratactl pack" in str(err.value)
    source.close()


def test_corrupted_blob_is_not_pinned_and_stays_named(
    packed: tuple[Path, Manifest], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, manifest = packed
    broken = tmp_path / "broken.pack"
    shutil.copytree(src, broken)
    with open(broken / EXPERTS_NAME, "r+b") as f:
        f.seek(manifest.blob(1, 3).offset)
        f.write(b"\xff" * 16)
    source = PackExperts(broken)
    units = [ExpertUnit(1, e) for e in range(8)]
    ram = ResidentRAM(units, [manifest.layouts[1].stride] * 8)
    pinner = Pinner(ram, source, LockChoice(NoLocker(), None), PinSettings(1 << 20, 0))
    pinner.start()
    assert pinner.wait(timeout=30) and pinner.error is None
    assert ram.ready == [True, True, True, False, True, True, True, True]
    assert [u for u, _ in pinner.failed] == [ExpertUnit(1, 3)]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("resident copy of layer 1, expert 3 skipped:")
    assert "the blob of layer 1, expert 3" in errors[0]
    ram.close()
    source.close()


def test_unknown_manifest_version_is_refused(packed: tuple[Path, Manifest], tmp_path: Path) -> None:
    src, _ = packed
    future = tmp_path / "future.pack"
    shutil.copytree(src, future)
    doc = msgspec.json.decode((future / MANIFEST_NAME).read_bytes())
    doc["format_version"] = 99
    doc["layouts"] = "a field this reader does not know how to read"
    (future / MANIFEST_NAME).write_bytes(msgspec.json.encode(doc))
    expected = (
        f"{future / MANIFEST_NAME}: pack format version 99 is not supported (this stratad reads"
        " version 1); the pack was written by a newer Strata: re-create it with `stratactl pack`"
    )
    for open_it in (read_manifest, PackExperts, load_pack):
        with pytest.raises(PackError) as err:
            open_it(future)
        assert str(err.value) == expected
    with pytest.raises(PackError, match="no manifest.json \\(not a Strata pack\\)"):
        read_manifest(tmp_path)


def test_truncated_pack_is_refused(packed: tuple[Path, Manifest], tmp_path: Path) -> None:
    src, manifest = packed
    short = tmp_path / "short.pack"
    shutil.copytree(src, short)
    with open(short / EXPERTS_NAME, "r+b") as f:
        f.truncate(manifest.experts_nbytes - BLOB_ALIGN)
    with pytest.raises(
        PackError, match="bytes, the manifest says .* \\(truncated or replaced\\?\\)"
    ):
        PackExperts(short)


def test_dense_model_is_refused(smollm_path: Path, tmp_path: Path) -> None:
    with pytest.raises(PackError, match="a llama model has no routed experts to pack"):
        write_pack(smollm_path, tmp_path / "dense.pack")
    assert not list(tmp_path.iterdir())


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stratactl")
    pack_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli(gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.pack"
    assert _cli(["pack", str(gguf), "-o", str(out)]) == 0
    assert f"wrote {out}: qwen3moe, 4 layers x 8 experts" in capsys.readouterr().out
    assert _cli(["pack", str(gguf), "-o", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert _cli(["pack", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "x")]) == 1
    assert "no such model file" in capsys.readouterr().err


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, stratactl.pack; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
