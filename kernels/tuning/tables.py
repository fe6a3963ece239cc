"""Which kernel tuning table fits the installed GPU stack (selection only: no torch, no tuner).

A table is a JSON file named `<arch>-<backend>-<version>.json`, e.g. `gfx1100-rocm-7.2.0.json` or
`sm90-cuda-12.8.json`: launch settings measured on that GPU architecture with that runtime
(`kernels.tuning.table_file` reads its content). The version is ROCm's `major.minor.patch`, or
CUDA's `major.minor`. Lookup: the exact stack; else the table of the nearest runtime version of the
same architecture and backend, with one WARNING naming both versions (settings tuned under one
compiler can be slower under another; the table's header may record by how much); else the kernels'
default settings, said once. Shipped tables live in `kernels/tables/` (package data); `stratactl
tune` writes to the state directory, which shadows them.

Detection reads files, so tests point it at a fake tree (`root`):
- ROCm: `<rocm>/.info/version` (or `include/rocm-core/rocm_version.h`) for the version, and the
  KFD topology in sysfs (`gfx_target_version` of each GPU node) for the architecture, with
  `HSA_OVERRIDE_GFX_VERSION` applied as the runtime applies it;
- CUDA: `<cuda>/version.json` (else `version.txt`, else `bin/nvcc --version`) for the version,
  `nvidia-smi` for the compute capability.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kernels.tuning import table_file

PACKAGED_DIR = Path(__file__).parents[1] / "tables"
STATE_DIR = Path("/var/lib/strata/tables")  # where `stratactl tune` writes (StateDirectory)
SEARCH_PATH = (STATE_DIR, PACKAGED_DIR)

Backend = Literal["rocm", "cuda"]
_NAME = re.compile(
    r"^(?P<arch>(gfx[0-9a-f]+|sm[0-9]+a?))-(?P<backend>rocm|cuda)-(?P<version>\d+(\.\d+)*)\.json$"
)

NEAREST: Literal["nearest-version"] = "nearest-version"
COST = (
    "the kernels run with their default launch settings: expect slower prefill and decode"
    " (upstream users measured up to 45% less prompt speed on a mismatched stack)"
)


class TableError(RuntimeError):
    """The GPU stack cannot be detected."""


@dataclass(frozen=True, order=True)
class Stack:
    arch: str  # gfx1100, gfx942, sm90
    backend: Backend
    version: str  # 7.2.0 (ROCm), 12.8 (CUDA)

    @property
    def key(self) -> str:
        return f"{self.arch}-{self.backend}-{self.version}"

    @property
    def file_name(self) -> str:
        return f"{self.key}.json"


def parse_name(name: str) -> Stack | None:
    m = _NAME.match(name)
    if m is None:
        return None
    return Stack(m["arch"], m["backend"], m["version"])  # type: ignore[arg-type]


# ---- detection --------------------------------------------------------------------------


def gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) as an LLVM target name."""
    major, minor, step = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def rocm_gpu_archs(root: Path = Path("/")) -> list[str]:
    """The gfx architectures of the GPU nodes in the KFD topology, in node order."""
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    archs = []
    for node in sorted(nodes.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        try:
            text = (node / "properties").read_text()
        except OSError:
            continue
        m = re.search(r"^gfx_target_version\s+(\d+)", text, re.M)
        if m and int(m[1]):  # CPU nodes say 0
            archs.append(gfx_name(int(m[1])))
    return archs


def rocm_version(rocm: Path) -> str | None:
    """ROCm's major.minor.patch from an install tree (/opt/rocm), or None."""
    try:
        m = re.match(r"(\d+)\.(\d+)\.(\d+)", (rocm / ".info/version").read_text().strip())
        if m:
            return ".".join(m.groups())
    except OSError:
        pass
    for header in ("include/rocm-core/rocm_version.h", "include/rocm_version.h"):
        try:
            text = (rocm / header).read_text()
        except OSError:
            continue
        parts = [re.search(rf"#define\s+ROCM_VERSION_{p}\s+(\d+)", text) for p in
                 ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return ".".join(p[1] for p in parts if p)
    return None


def override_arch(hsa_override: str) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION=11.0.0 -> gfx1100 (the arch the runtime then targets)."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", hsa_override.strip())
    if m is None:
        return None
    major, minor, step = (int(x) for x in m.groups())
    return gfx_name(major * 10000 + minor * 100 + step)


def cuda_version(cuda: Path) -> str | None:
    """CUDA's major.minor under `cuda`: version.json (CUDA 11.1 and later), else version.txt
    (older toolkits), else what `bin/nvcc --version` says (images that ship the compiler and
    neither file)."""
    try:
        version = json.loads((cuda / "version.json").read_text())["cuda"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        version = None
    if version is None:
        try:
            version = (cuda / "version.txt").read_text()
        except OSError:
            version = _nvcc_release(cuda / "bin" / "nvcc")
    m = re.search(r"(\d+)\.(\d+)", str(version)) if version else None
    return f"{m[1]}.{m[2]}" if m else None


def _nvcc_release(nvcc: Path) -> str | None:
    """"release 13.0" from `nvcc --version`, or None."""
    if not nvcc.is_file():
        return None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m[1] if m else None


def nvidia_archs(run: Callable[[list[str]], str] | None = None) -> list[str]:
    """sm<major><minor> of each NVIDIA GPU, from nvidia-smi (none if it is missing)."""
    if run is None:
        if shutil.which("nvidia-smi") is None:
            return []

        def run(cmd: list[str]) -> str:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout

    try:
        out = run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError):
        return []
    return [f"sm{line.strip().replace('.', '')}" for line in out.splitlines()
            if re.fullmatch(r"\d+\.\d+", line.strip())]


def _stacks(archs: Sequence[str], backend: Backend, version: str) -> tuple[Stack, ...]:
    return tuple(dict.fromkeys(Stack(a, backend, version) for a in archs))


@dataclass(frozen=True)
class Detected:
    stacks: tuple[Stack, ...]  # one per GPU (distinct)
    notes: tuple[str, ...] = ()  # how it was found, overrides applied


def detect(
    root: Path = Path("/"),
    rocm_path: str | None = None,
    cuda_path: str | None = None,
    hsa_override: str | None = None,
    nvidia_smi: Callable[[list[str]], str] | None = None,
) -> Detected:
    """The installed GPU stacks; raises TableError when there is a GPU but no runtime version."""
    notes: list[str] = []
    archs = rocm_gpu_archs(root)
    if archs:
        rocm = root / (rocm_path or "opt/rocm").lstrip("/")
        version = rocm_version(rocm)
        if version is None:
            raise TableError(f"AMD GPU {', '.join(archs)} found but no ROCm version under {rocm}"
                             " (.info/version); pass --rocm-path or --version")
        if hsa_override:
            forced = override_arch(hsa_override)
            if forced is None:
                raise TableError(f"HSA_OVERRIDE_GFX_VERSION={hsa_override!r}: not X.Y.Z")
            notes.append(f"HSA_OVERRIDE_GFX_VERSION={hsa_override}: the runtime treats"
                         f" {', '.join(sorted(set(archs)))} as {forced}")
            archs = [forced]
        notes.append(f"ROCm {version} from {rocm}")
        return Detected(_stacks(archs, "rocm", version), tuple(notes))
    archs = nvidia_archs(nvidia_smi)
    if archs:
        cuda = root / (cuda_path or "usr/local/cuda").lstrip("/")
        version = cuda_version(cuda)
        if version is None:
            raise TableError(f"NVIDIA GPU {', '.join(archs)} found but no CUDA version under"
                             f" {cuda} (version.json, version.txt, bin/nvcc);"
                             " pass --cuda-path or --version")
        notes.append(f"CUDA {version} from {cuda}")
        return Detected(_stacks(archs, "cuda", version), tuple(notes))
    return Detected((), ("no GPU found (no KFD GPU node, no nvidia-smi GPU)",))


# ---- selection --------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    stack: Stack
    path: Path | None  # the table to use, or None
    reason: Literal["match", "nearest-version", "no-table", "other-arch", "refused"]
    message: str
    others: tuple[Path, ...] = field(default=())  # tables that exist but do not fit

    @property
    def matched(self) -> bool:
        """A table is used (the exact one, or the nearest version's)."""
        return self.path is not None

    @property
    def exact(self) -> bool:
        return self.reason == "match"


def available(dirs: Sequence[Path] = SEARCH_PATH) -> list[tuple[Path, Stack]]:
    """Every table in `dirs` whose name parses; earlier dirs shadow later ones."""
    seen: dict[str, tuple[Path, Stack]] = {}
    for d in dirs:
        for path in sorted(d.glob("*.json")) if d.is_dir() else ():
            stack = parse_name(path.name)
            if stack is not None and path.name not in seen:
                seen[path.name] = (path, stack)
    return sorted(seen.values(), key=lambda t: t[1])


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def nearest_version(version: str, others: Sequence[str]) -> str:
    """The version in `others` nearest to `version`: the smallest difference in the first part
    that differs (13.0 -> 12.8 over 11.8; 7.2.1 -> 7.2.0 over 7.1.0); a tie goes to the older."""

    def distance(other: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        a, b = version_tuple(version), version_tuple(other)
        width = max(len(a), len(b))
        a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
        return tuple(abs(x - y) for x, y in zip(a, b, strict=True)), b

    return min(others, key=distance)


def _header_problem(path: Path, stack: Stack) -> tuple[str | None, str | None]:
    """(why the table at `path` is refused, or None; the mismatch cost its header records)."""
    try:
        header = table_file.header_of(table_file.load(path), stack.key, str(path))
    except table_file.TableFileError as err:
        return str(err), None
    return None, header.mismatch_cost


def select(stack: Stack, dirs: Sequence[Path] = SEARCH_PATH) -> Choice:
    tables = available(dirs)
    where = ", ".join(str(d) for d in dirs)
    for path, s in tables:
        if s == stack:
            problem, _ = _header_problem(path, stack)
            if problem is not None:
                return Choice(stack, None, "refused", f"{problem}: refused; {COST}", (path,))
            return Choice(stack, path, "match", f"{stack.key}: using {path}")
    same_arch = {s.version: (p, s) for p, s in tables
                 if s.arch == stack.arch and s.backend == stack.backend}
    same_version = [(p, s) for p, s in tables
                    if s.backend == stack.backend and s.version == stack.version]
    if same_arch:
        path, near = same_arch[nearest_version(stack.version, list(same_arch))]
        problem, cost = _header_problem(path, near)
        if problem is not None:
            return Choice(stack, None, "refused", f"no tuning table for {stack.key}, and the"
                          f" nearest version's {problem}: refused; {COST}", (path,))
        measured = (f"measured cost of a mismatch: {cost}" if cost else
                    "the cost of the mismatch was not measured")
        return Choice(stack, path, NEAREST,
                      f"no tuning table for {stack.key}: using {path}, tuned for {stack.backend}"
                      f" {near.version}, on {stack.backend} {stack.version} (settings tuned under"
                      f" another runtime version can be slower; {measured}). Write one for this"
                      " stack with `stratactl tune`.",
                      tuple(p for p, _ in same_arch.values() if p != path))
    if same_version:
        archs = ", ".join(s.arch for _, s in same_version)
        return Choice(stack, None, "other-arch",
                      f"no tuning table for {stack.key}: {stack.backend} {stack.version} tables"
                      f" exist only for {archs}, not for this GPU's {stack.arch}; {COST}."
                      " Write one with `stratactl tune`.",
                      tuple(p for p, _ in same_version))
    return Choice(stack, None, "no-table",
                  f"no tuning table for {stack.key} (looked in {where}); {COST}."
                  " Write one with `stratactl tune`.")
