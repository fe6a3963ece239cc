"""`kernels.cpu.file_pages`: a read-only file mapping's pages leave the resident set when the
kernels read a copy, and nothing else is touched."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.cpu.file_pages import FileMappings


def _resident_kib(address: int) -> int:
    """The Rss of the mapping holding `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_read_only_file_mapping_is_released(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 * mmap.PAGESIZE, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")  # as the GGUF reader maps a file
    t = torch.from_numpy(np.asarray(mapped))  # a read-only view (reads only)
    assert int(t.sum()) == int(data.sum())  # every page faulted in
    before = _resident_kib(t.data_ptr())
    inner = t[100 : 100 + 40 * mmap.PAGESIZE]  # a tensor inside: its whole pages only
    released = FileMappings.now().release(inner)
    assert released == 39 * mmap.PAGESIZE
    assert _resident_kib(t.data_ptr()) <= before - released // 1024
    assert torch.equal(t, torch.from_numpy(data))  # read again from the file: unchanged


def test_other_memory_is_left_alone() -> None:
    anon = torch.arange(16 * mmap.PAGESIZE, dtype=torch.uint8)  # anonymous: would be zeroed
    files = FileMappings.now()
    assert not files.holds(anon.data_ptr(), anon.numel())
    assert files.release(anon) == 0
    assert torch.equal(anon, torch.arange(16 * mmap.PAGESIZE, dtype=torch.uint8))
    assert FileMappings.now(Path("/nonexistent/maps")).release(anon) == 0
