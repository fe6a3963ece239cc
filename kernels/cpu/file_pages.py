"""Give a read-only file mapping's resident pages back once the kernels read a copy instead.

A weight the CPU kernels read in another layout (`kernels/cpu/interleave.h`) is copied out of
the GGUF file's mapping; the copy is read from then on, but the pages the copy was made from
stay in the process's resident set (a file's mapped pages count in RSS). Where the weight's
memory lies in a read-only mapping of a file (the GGUF reader's), `release` drops its whole
pages from this process with madvise(MADV_DONTNEED): the file's bytes are unchanged, and a
later read (an embedding row of a tied head) faults them in again from the page cache. Any
other memory (anonymous, writable) is left alone: there the call would discard data.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

MADV_DONTNEED = 4  # Linux's


@dataclass(frozen=True)
class FileMappings:
    """This process's read-only file mappings at one moment: (start, end) address ranges,
    sorted."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def now(cls, maps: Path = Path("/proc/self/maps")) -> FileMappings:
        """Read them from /proc (none where it cannot be read: nothing will be released)."""
        try:
            lines = maps.read_text().splitlines()
        except OSError:
            return cls(())
        ranges = []
        for line in lines:  # start-end perms offset dev inode [path]
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[1][1] == "-" and parts[5].startswith("/"):
                start, end = (int(a, 16) for a in parts[0].split("-"))
                ranges.append((start, end))
        return cls(tuple(sorted(ranges)))

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies inside one read-only file mapping."""
        i = bisect.bisect_right(self.ranges, (address, float("inf"))) - 1
        return i >= 0 and self.ranges[i][0] <= address and address + nbytes <= self.ranges[i][1]

    def release(self, t: torch.Tensor) -> int:
        """Drop the whole pages of t's bytes from the resident set where they lie in a
        read-only file mapping; the bytes released (0 where they do not, or none is whole)."""
        address, nbytes = t.data_ptr(), t.numel() * t.element_size()
        page = mmap.PAGESIZE
        start, end = -(-address // page) * page, (address + nbytes) // page * page
        if end <= start or not self.holds(address, nbytes):
            return 0
        rc = _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
        return end - start if rc == 0 else 0


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.madvise.restype = ctypes.c_int
    return _LIBC
