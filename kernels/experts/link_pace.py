"""A slower PCIe link, emulated on a fast one (benchmarks only): after a layer's miss copy, the
stream waits on the GPU as long as the missed blobs would have taken at the slower rate
beyond what the copy took, so a consumer card's link (PCIe 4.0 x16, about 25 GB/s) can be
measured on a server's (55 GB/s) without touching the host.

One program counts the step's misses as the fetch kernel does (a routed id whose address lies
in the page-locked RAM copy) and spins on the GPU's global timer for `ns_per_blob` each. It
runs in a CUDA graph like the rest of a decode step; it needs the GPU's timer, so there is no
CPU interpreter path (`pace_ns` is the reference of how long it waits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer


@triton.jit(do_not_specialize=["n", "ns_per_blob"])  # one compile for every wait
def _pace_kernel(ids_ptr, table_ptr, n, lo, hi, ns_per_blob, BLOCK: tl.constexpr):
    start = globaltimer()
    offs = tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int64)
    hit = (offs < n) & (e >= 0)
    addr = tl.load(table_ptr + e * 3, mask=hit, other=0)
    missed = tl.sum(((addr >= lo) & (addr < hi) & hit).to(tl.int64), axis=0)
    wait = missed * ns_per_blob
    now = globaltimer()
    while now - start < wait:
        now = globaltimer()


def pace_link(ids: torch.Tensor, table: torch.Tensor, host: tuple[int, int],
              ns_per_blob: int) -> None:
    """Queue a wait of `ns_per_blob` per missed blob of ids [T, k] (table [E, 3] the layer's
    addresses, host the RAM copy's byte range)."""
    n = ids.numel()
    if n == 0 or ns_per_blob <= 0:
        return
    _pace_kernel[(1,)](ids, table, n, host[0], host[1], ns_per_blob,
                       BLOCK=triton.next_power_of_2(n))  # fmt: skip


def pace_ns(ids: torch.Tensor, table: torch.Tensor, host: tuple[int, int],
            ns_per_blob: int) -> int:
    """How long `pace_link` waits (the reference)."""
    flat = [e for e in ids.reshape(-1).tolist() if e >= 0]
    rows = table[:, 0].tolist()
    return sum(ns_per_blob for e in flat if host[0] <= rows[e] < host[1])


def ns_per_blob(blob_bytes: float, link_bps: float, copy_bps: float) -> int:
    """The wait per blob that turns a copy at `copy_bps` into one at `link_bps`."""
    if link_bps <= 0 or copy_bps <= 0:
        raise ValueError("rates must be positive")
    return max(0, round(blob_bytes * (1 / link_bps - 1 / copy_bps) * 1e9))
