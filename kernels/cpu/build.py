"""Compile the CPU expert kernels (`kernels/cpu/*.c`) at first use and load them with ctypes.

The shared library is cached under `$XDG_CACHE_HOME/strata/cpu-kernels` (else
`~/.cache/strata/cpu-kernels`), named by a hash of the sources, the flags, the compiler's
version and (for -march=native) the CPU's model and flags, so an edit, a new compiler or
another host builds afresh and an unchanged tree loads in milliseconds. The build writes a
temporary file and renames it into place: two processes starting at once both build, and the
last rename wins with an identical file.

The compiler is `$CC`, else `cc`, else `gcc`. Without one, or when the build fails,
`CpuKernelsUnavailable` says why in one line (the engine then falls back to torch).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
MAIN = "experts.c"  # includes the headers beside it; all of them go into the cache key
FLAGS = ("-std=c11", "-O3", "-fopenmp", "-shared", "-fPIC")
NATIVE = "-march=native"


class CpuKernelsUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here (no compiler, or the build failed)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata" / "cpu-kernels"


def compiler() -> list[str]:
    """The C compiler command: $CC (may hold arguments), else cc, else gcc."""
    cc = os.environ.get("CC")
    if cc:
        argv = shlex.split(cc)
        if not argv or shutil.which(argv[0]) is None:
            raise CpuKernelsUnavailable(f"CPU kernels: the compiler CC={cc!r} was not found")
        return argv
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return [name]
    raise CpuKernelsUnavailable("CPU kernels: no C compiler (cc or gcc) on PATH; install gcc")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def _version(cc: list[str]) -> str:
    try:
        done = _run([*cc, "--version"])
    except OSError as e:
        raise CpuKernelsUnavailable(f"CPU kernels: cannot run {cc[0]}: {e}") from None
    return done.stdout + done.stderr


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no output"])[0]


def _host_cpu() -> str:
    """What -march=native resolves from: the CPU's model and flags (a cache directory shared
    between hosts must not hand one host's instructions to another)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keys}))


def build(cache_dir: Path | None = None, native: bool = True, source: Path = SOURCE_DIR) -> Path:
    """The path of the compiled library, building it if the cache does not hold it.

    native=False builds for the baseline of the target (no -march=native): the portable C
    paths, not the AVX2 ones, for the tests to check both. `source`: the folder of the C
    sources (this package's; another commit's for `bench.cpu.ab_kernels`)."""
    cc = compiler()
    version = _version(cc)
    digest = hashlib.sha256()
    for path in sorted(source.glob("*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    march = (NATIVE,) if native else ()
    digest.update(repr((cc, FLAGS, march, version, _host_cpu() if native else "")).encode())
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    lib = directory / f"experts-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CpuKernelsUnavailable(f"CPU kernels: cache directory {directory}: {e}") from None
    fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        src = str(source / MAIN)
        done = _run([*cc, *FLAGS, *march, "-o", tmp, src])
        if done.returncode != 0 and march and "march" in done.stderr:  # a compiler without it
            done = _run([*cc, *FLAGS, "-o", tmp, src])
        if done.returncode != 0:
            raise CpuKernelsUnavailable(
                f"CPU kernels: {cc[0]} failed to build {MAIN}: {_first_error(done.stderr)}"
            )
        os.replace(tmp, lib)
    except OSError as e:
        raise CpuKernelsUnavailable(f"CPU kernels: building with {cc[0]}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


# OpenMP threads that spin after a parallel region (the default) take the cores from torch's
# own OpenMP team, from the thread that queues GPU work, and from each other: with two
# runtimes in one process (torch's and ours) a 20 us product took 0.7-16 ms on a busy 2-core
# host. Passive waiting costs a wake-up per call and removes that. A value the user set wins.
OMP_WAIT = ("OMP_WAIT_POLICY", "PASSIVE")


def quiet_openmp() -> None:
    """Ask OpenMP runtimes loaded from now on to wait passively (before torch's import, the
    daemon's and the tests' entry points call it so torch's team waits passively too)."""
    os.environ.setdefault(*OMP_WAIT)


def load(
    cache_dir: Path | None = None, native: bool = True, source: Path = SOURCE_DIR
) -> ctypes.CDLL:
    """Build if needed, then load the library (its functions release the GIL when called)."""
    quiet_openmp()  # our runtime reads it when the library loads
    lib = build(cache_dir, native, source)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        raise CpuKernelsUnavailable(f"CPU kernels: cannot load {lib}: {e}") from None
