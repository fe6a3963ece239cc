"""Run a benchmark's process as on a host with less RAM: a memory cgroup of its own.

`confine(gib)` puts the calling process into a new memory cgroup limited to `gib` GiB (cgroup
v2's `memory.max`, else v1's `memory.limit_in_bytes`): its anonymous memory, locked memory
and the page cache it brings in all count, so a model larger than the limit is read from the
disk again whenever the kernel had to drop its pages, as on a host with that much RAM. Needs
root (or a delegated cgroup). `drop_cached(path)` asks the kernel to forget the file's cached
pages first: pages cached before, charged to another cgroup, would not count against the
limit.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


class MemLimitUnavailable(RuntimeError):
    """No memory cgroup can be made here (not root, or no memory controller)."""


def _root() -> tuple[Path, str]:
    """The cgroup directory to make children in and the limit's file name."""
    if (V2 / "cgroup.controllers").is_file() and "memory" in (
        V2 / "cgroup.controllers"
    ).read_text():
        own = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2]
        return V2 / own.lstrip("/"), "memory.max"
    if (V1 / "memory.limit_in_bytes").is_file():
        return V1, "memory.limit_in_bytes"
    raise MemLimitUnavailable("no memory cgroup controller is mounted")


def confine(gib: float, name: str) -> Path:
    """Move this process into a new memory cgroup `name` of `gib` GiB; its directory."""
    root, limit = _root()
    group = root / name
    try:
        group.mkdir(exist_ok=True)
        (group / limit).write_text(str(int(gib * 2**30)))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise MemLimitUnavailable(f"cannot make or join the memory cgroup {group}: {e}") from None
    return group


def remove(name: str) -> None:
    """Remove the cgroup `name` once its processes have exited (if it was made)."""
    with contextlib.suppress(OSError, MemLimitUnavailable):
        (_root()[0] / name).rmdir()


def drop_cached(path: Path) -> None:
    """Ask the kernel to drop the file's clean cached pages (those no process maps)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def peak_bytes(group: Path) -> int | None:
    """The cgroup's peak memory (v2 memory.peak, v1 memory.max_usage_in_bytes), if kept."""
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        if (group / name).is_file():
            return int((group / name).read_text().split()[0])
    return None
