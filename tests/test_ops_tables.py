"""`stratactl tables select` against fake ROCm (and CUDA) trees: exact match, no match, wrong
arch, an HSA override, a table whose content disagrees with its name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kernels.tuning import tables
from stratactl.__main__ import main as stratactl


def rocm_tree(root: Path, version: str, gfx_targets: list[int]) -> Path:
    """A fake host: /opt/rocm/.info/version and KFD topology nodes (node 0 is the CPU)."""
    info = root / "opt/rocm/.info"
    info.mkdir(parents=True)
    (info / "version").write_text(f"{version}-120\n")
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    for i, target in enumerate([0, *gfx_targets]):
        (nodes / str(i)).mkdir(parents=True)
        (nodes / str(i) / "properties").write_text(
            f"cpu_cores_count {16 if i == 0 else 0}\nsimd_count 0\n"
            f"gfx_target_version {target}\nvendor_id 4098\n")
    return root


def table_dir(root: Path, *names: str) -> Path:
    d = root / "tables"
    d.mkdir()
    for name in names:
        (d / name).write_text(json.dumps({"key": name.removesuffix(".json")}))
    return d


def select(root: Path, tdir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[
        int, str, str]:
    rc = stratactl(["tables", "select", "--root", str(root), "--tables-dir", str(tdir), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(autouse=True)
def _no_host_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HSA_OVERRIDE_GFX_VERSION", "ROCM_PATH", "CUDA_HOME"):
        monkeypatch.delenv(name, raising=False)


def test_gfx_names() -> None:
    assert [tables.gfx_name(v) for v in (110000, 90402, 90010, 100300, 110501)] == [
        "gfx1100", "gfx942", "gfx90a", "gfx1030", "gfx1151"]
    assert tables.parse_name("gfx1100-rocm-7.2.0.json") == tables.Stack("gfx1100", "rocm", "7.2.0")
    assert tables.parse_name("gfx1100-hipblaslt-100201.txt") is None


def test_exact_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = rocm_tree(tmp_path, "7.2.0", [110000])
    tdir = table_dir(tmp_path, "gfx1100-rocm-7.1.0.json", "gfx1100-rocm-7.2.0.json",
                     "gfx942-rocm-7.2.0.json")
    rc, out, _ = select(root, tdir, capsys)
    assert rc == 0
    assert f"detected: ROCm 7.2.0 from {root}/opt/rocm" in out
    assert f"ok   gfx1100-rocm-7.2.0: using {tdir}/gfx1100-rocm-7.2.0.json" in out
    rc, out, _ = select(root, tdir, capsys, "--json")
    choice = json.loads(out)["choices"][0]
    assert rc == 0 and choice["matched"] and choice["reason"] == "match"


def test_nearest_rocm_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = rocm_tree(tmp_path, "7.2.1", [110000])
    tdir = table_dir(tmp_path, "gfx1100-rocm-7.1.0.json", "gfx1100-rocm-7.2.0.json")
    rc, out, _ = select(root, tdir, capsys)
    assert rc == 3  # not exact: the daemon uses it, with a warning
    assert (f"warn no tuning table for gfx1100-rocm-7.2.1: using {tdir}/gfx1100-rocm-7.2.0.json,"
            " tuned for rocm 7.2.0, on rocm 7.2.1") in out
    assert "the cost of the mismatch was not measured" in out and "stratactl tune" in out
    rc, out, _ = select(root, tdir, capsys, "--json")
    choice = json.loads(out)["choices"][0]
    assert choice["reason"] == "nearest-version" and choice["matched"] and not choice["exact"]


def test_wrong_arch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = rocm_tree(tmp_path, "6.4.1", [90402])  # an MI300X (gfx942)
    tdir = table_dir(tmp_path, "gfx1100-rocm-6.4.1.json", "gfx1030-rocm-6.4.1.json")
    rc, out, _ = select(root, tdir, capsys, "--json")
    choice = json.loads(out)["choices"][0]
    assert rc == 3 and choice["reason"] == "other-arch" and choice["path"] is None
    assert "rocm 6.4.1 tables exist only for gfx1030, gfx1100, not for this GPU's gfx942" in (
        choice["message"])


def test_no_table_at_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = rocm_tree(tmp_path, "6.4.1", [110000])
    tdir = table_dir(tmp_path)
    rc, out, _ = select(root, tdir, capsys)
    assert rc == 3 and f"no tuning table for gfx1100-rocm-6.4.1 (looked in {tdir})" in out


def test_hsa_override_changes_the_arch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root = rocm_tree(tmp_path, "7.2.0", [110001])  # gfx1101, run as gfx1100
    tdir = table_dir(tmp_path, "gfx1100-rocm-7.2.0.json")
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "11.0.0")
    rc, out, _ = select(root, tdir, capsys)
    assert rc == 0
    assert "HSA_OVERRIDE_GFX_VERSION=11.0.0: the runtime treats gfx1101 as gfx1100" in out


def test_table_that_lies_about_its_stack_is_refused(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root = rocm_tree(tmp_path, "7.2.0", [110000])
    tdir = table_dir(tmp_path)
    (tdir / "gfx1100-rocm-7.2.0.json").write_text('{"key": "gfx1100-rocm-7.1.0"}')
    rc, out, _ = select(root, tdir, capsys)
    assert rc == 3 and "says it was tuned for gfx1100-rocm-7.1.0: refused" in out


def test_two_gpus_two_archs(tmp_path: Path) -> None:
    root = rocm_tree(tmp_path, "7.2.0", [110000, 110000, 90402])
    found = tables.detect(root)
    assert [s.key for s in found.stacks] == ["gfx1100-rocm-7.2.0", "gfx942-rocm-7.2.0"]


def test_version_from_the_header_when_info_is_missing(tmp_path: Path) -> None:
    rocm = tmp_path / "opt/rocm"
    (rocm / "include/rocm-core").mkdir(parents=True)
    (rocm / "include/rocm-core/rocm_version.h").write_text(
        "#define ROCM_VERSION_MAJOR   6\n#define ROCM_VERSION_MINOR   4\n"
        "#define ROCM_VERSION_PATCH   3\n")
    assert tables.rocm_version(rocm) == "6.4.3"


def test_gpu_without_rocm_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = rocm_tree(tmp_path, "7.2.0", [110000])
    (root / "opt/rocm/.info/version").unlink()
    rc, _, err = select(root, table_dir(tmp_path), capsys)
    assert rc == 1 and "AMD GPU gfx1100 found but no ROCm version under" in err


def test_no_gpu_nothing_to_select(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU host: the cpu engine's kernels need no table, which is the answer (exit 0)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either
    line = "no GPU: nothing to select on a CPU (the cpu engine's kernels need no tuning table)"
    assert select(tmp_path, table_dir(tmp_path), capsys) == (0, line + "\n", "")
    rc, out, _ = select(tmp_path, tmp_path / "tables", capsys, "--json")
    assert rc == 0 and json.loads(out) == {
        "stacks": [], "notes": ["no GPU found (no KFD GPU node, no nvidia-smi GPU)"],
        "message": line}  # fmt: skip


def test_cuda_through_a_stub_nvidia_smi(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 9.0\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cuda = tmp_path / "usr/local/cuda"
    cuda.mkdir(parents=True)
    (cuda / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.8.1"}}')
    rc, out, _ = select(tmp_path, table_dir(tmp_path, "sm90-cuda-12.8.json"), capsys)
    assert rc == 0 and "ok   sm90-cuda-12.8: using" in out


def test_explicit_stack_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tdir = table_dir(tmp_path, "gfx1100-rocm-7.2.0.json", "README.json")
    assert stratactl(["tables", "select", "--stack", "gfx1100-rocm-7.2.0",
                      "--tables-dir", str(tdir)]) == 0
    capsys.readouterr()
    assert stratactl(["tables", "list", "--tables-dir", str(tdir)]) == 0
    assert capsys.readouterr().out.split() == [str(tdir / "gfx1100-rocm-7.2.0.json")]


def test_cuda_version_without_version_json(tmp_path: Path) -> None:
    """Images with the compiler but no version.json (NVIDIA's CUDA 13 containers): nvcc says."""
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    assert tables.cuda_version(cuda) is None
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    assert tables.cuda_version(cuda) == "13.0"
    (cuda / "version.txt").write_text("CUDA Version 11.0.228\n")  # older toolkits: before nvcc
    assert tables.cuda_version(cuda) == "11.0"
