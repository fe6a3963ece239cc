"""The two bandwidths the coverage cost estimate needs, measured at start in well under a second:
reading blobs from the file (page cache dropped first, so it is the disk's), and copying a
resident blob to where the engine computes (pinned host -> GPU, or RAM -> RAM on a CPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stratad.store.pack.manifest import PackError
from stratad.store.sizes import MiB
from stratad.store.tiers.sources import ExpertSource


@dataclass(frozen=True)
class Bandwidths:
    file_bps: float  # bytes/s read from the file tier
    copy_bps: float  # bytes/s copied from the resident RAM tier to the compute device

    def describe(self) -> str:
        return (
            f"file read {self.file_bps / 1e9:.2f} GB/s,"
            f" resident copy {self.copy_bps / 1e9:.2f} GB/s"
        )


def measure_file(source: ExpertSource, sample_bytes: int = 32 * MiB) -> float:
    """Read blobs spread over the file (each layer's last experts, layer by layer) cold."""
    units = [
        (layer, source.n_experts - 1 - k)
        for k in range(source.n_experts)
        for layer in range(source.n_layers)
    ]
    picked, total = [], 0
    for layer, e in units:
        if total >= sample_bytes:
            break
        picked.append((layer, e))
        total += source.layouts[layer].nbytes
    buf = torch.empty(max(lay.stride for lay in source.layouts), dtype=torch.uint8)
    for layer, e in picked:
        source.drop_cache(layer, e)
    start, done = time.perf_counter(), 0
    for layer, e in picked:
        try:
            source.read_into(layer, e, buf)
        except PackError:  # a damaged blob is named when it is used, not by a probe
            continue
        done += source.layouts[layer].nbytes
    return done / max(time.perf_counter() - start, 1e-9)


def measure_copy(device: torch.device, sample_bytes: int = 32 * MiB) -> float:
    """Host -> `device` from page-locked memory (on a CPU: one RAM -> RAM copy)."""
    gpu = device.type == "cuda"
    src = torch.empty(sample_bytes, dtype=torch.uint8, pin_memory=gpu).fill_(1)
    dst = torch.empty(sample_bytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # warm: first touch of dst, driver setup
    if gpu:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=gpu)
    if gpu:
        torch.cuda.synchronize(device)
    return sample_bytes / max(time.perf_counter() - start, 1e-9)


def measure_bandwidths(source: ExpertSource, device: torch.device) -> Bandwidths:
    return Bandwidths(file_bps=measure_file(source), copy_bps=measure_copy(device))
