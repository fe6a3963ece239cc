"""The host's memory read bandwidth: a STREAM-like sum over a buffer larger than any
last-level cache, read by every core at once (one core reads a fraction of what the memory
can deliver: 10 of 121 GB/s on a 16-core Sapphire Rapids). The ceiling the CPU expert
kernels are measured against; numpy only, so front ends can run it."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

READ_BYTES = 1 << 30  # past a server's last-level cache (300 MiB on the H200 host)


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def read_bps(nbytes: int = READ_BYTES, passes: int = 3, threads: int | None = None) -> float:
    """Bytes/s of a sum over `nbytes`, split between `threads` (default: every core; numpy
    lets go of the GIL in a sum): the best of `passes`, after one untimed pass that faults
    the pages in."""
    n = threads or cores()
    data = np.ones(max(nbytes // 8, n), dtype=np.float64)
    parts = np.array_split(data, n)
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(np.sum, parts))
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return data.nbytes / best
