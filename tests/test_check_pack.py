"""`stratactl check` on a pack given as `model.path` (as the shipped unit's ExecStartPre runs
it): accepted when whole, refused when its blob list is short or points past the file (as the
daemon refuses to open it), and with `--verify` every checksum is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stratactl.__main__ import main as stratactl
from stratad.store.pack.manifest import EXPERTS_NAME, MANIFEST_NAME, PackError, read_manifest
from stratad.store.pack.write import write_pack
from stratad.store.tiers.sources import PackExperts
from tests.test_store_fakes import tiny_moe_gguf


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("check-pack") / "tiny-moe.pack"
    write_pack(tiny_moe_gguf(tmp_path_factory), out)
    return out


def _check(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str], *extra: str
           ) -> tuple[int, dict[str, dict[str, str]]]:  # fmt: skip
    config = tmp_path / "check.toml"
    store = "[store]\nresident_budget_gib = 1.0\nresident_headroom_gib = 0.5\n"
    config.write_text(f'[model]\npath = "{model}"\n[engine]\ndevice = "cpu"\n{store}')
    capsys.readouterr()
    rc = stratactl(["check", "--json", "--config", str(config), *extra])
    out = json.loads(capsys.readouterr().out)
    return rc, {c["name"]: c for c in out["checks"]}


def _edited(pack: Path, tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    copy = tmp_path / "edited.pack"
    shutil.copytree(pack, copy)
    raw = json.loads((copy / MANIFEST_NAME).read_text())
    edit(raw)
    (copy / MANIFEST_NAME).write_text(json.dumps(raw))
    return copy


def test_a_pack_as_model_path_passes(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, checks = _check(tmp_path, pack, capsys, "--verify")
    assert rc == 0, checks
    assert checks["model"]["detail"].startswith("tiny-moe.pack: qwen3moe, 4 layers, MoE, 8")
    assert checks["pack"]["status"] == "ok"
    assert "every checksum verified" in checks["pack"]["detail"]
    assert "coverage 32 of 32" in checks["plan"]["detail"]


def test_short_or_overlong_blob_lists_are_refused(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = (pack / EXPERTS_NAME).stat().st_size

    def short(m: dict) -> None:  # type: ignore[type-arg]
        m["blobs"].pop()

    def past(m: dict) -> None:  # type: ignore[type-arg]
        m["blobs"][5]["offset"] = size

    for edit, needle in ((short, "lists 31 expert blobs, the model has 32"),
                         (past, "layer 0, expert 5 ends at byte")):  # fmt: skip
        edited = _edited(pack, tmp_path, edit)
        rc, checks = _check(tmp_path, edited, capsys)
        assert rc == 1 and checks["pack"]["status"] == "fail", checks
        assert needle in checks["pack"]["detail"]
        with pytest.raises(PackError, match=needle):  # the daemon's open says the same
            PackExperts(edited)
        shutil.rmtree(edited)


def test_verify_names_a_damaged_blob(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "damaged.pack"
    shutil.copytree(pack, copy)
    blob = read_manifest(copy).blob(2, 6)
    with open(copy / EXPERTS_NAME, "r+b") as f:
        f.seek(blob.offset + 7)
        b = f.read(1)
        f.seek(blob.offset + 7)
        f.write(bytes([b[0] ^ 1]))
    rc, checks = _check(tmp_path, copy, capsys)
    assert rc == 0  # without --verify: the structure only (checksums on first read)
    rc, checks = _check(tmp_path, copy, capsys, "--verify")
    assert rc == 1 and checks["pack"]["status"] == "fail"
    assert checks["pack"]["detail"].startswith("1 blobs or tensors fail their checksum:")
    assert "layer 2, expert 6" in checks["pack"]["detail"]


def test_a_flipped_dense_byte_is_named_and_refused(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped byte in dense.bin (served silently before: logprobs moved, /health ok,
    `check --verify` exit 0) fails `check --verify` and the daemon's open of the pack."""
    from stratad.store.pack.manifest import DENSE_NAME
    from stratad.store.pack.packed import load_pack

    copy = tmp_path / "damaged.pack"
    shutil.copytree(pack, copy)
    manifest = read_manifest(copy)
    assert all(d.crc32 is not None for d in manifest.dense)
    t = next(d for d in manifest.dense if d.name == "model.norm.weight").tensor
    with open(copy / DENSE_NAME, "r+b") as f:
        f.seek(t.offset + 3)
        b = f.read(1)
        f.seek(t.offset + 3)
        f.write(bytes([b[0] ^ 0x10]))
    rc, checks = _check(tmp_path, copy, capsys, "--verify")
    assert rc == 1 and checks["pack"]["status"] == "fail"
    assert "model.norm.weight" in checks["pack"]["detail"], checks["pack"]
    with pytest.raises(PackError, match="model.norm.weight .* fails its checksum"):
        load_pack(copy)
    load_pack(pack)  # the intact one opens
