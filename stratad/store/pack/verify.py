"""Every checksum of a pack on request (`stratactl check --verify`): each blob of experts.bin
and each tensor of dense.bin read and its CRC-32 checked, each one that fails named. (Its
structure is checked at every open, `manifest.check_blobs`, and so are the dense tensors'
checksums: the daemon reads them whole at start.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from stratad.store.pack.manifest import DENSE_NAME, Manifest, check_dense
from stratad.store.pack.packed import map_file
from stratad.store.tiers.sources import BlobCorrupt, PackExperts


def verify_checksums(
    pack_dir: Path,
    manifest: Manifest,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> list[str]:
    """Read every blob of the pack and check its CRC-32: the messages of those that fail
    (empty when the pack is intact). `on_progress(done, total, elapsed_s)` now and then."""
    source = PackExperts(Path(pack_dir), manifest)
    buf = torch.empty(max(lay.nbytes for lay in manifest.layouts), dtype=torch.uint8)
    failed: list[str] = []
    total, t0, last = len(manifest.blobs), time.monotonic(), 0.0
    try:
        for i, b in enumerate(manifest.blobs):
            try:
                source.read_into(b.layer, b.expert, buf)
            except BlobCorrupt as e:
                failed.append(str(e))
            now = time.monotonic()
            if on_progress is not None and (now - last > 2.0 or i + 1 == total):
                on_progress(i + 1, total, now - t0)
                last = now
    finally:
        source.close()
    dense = map_file(Path(pack_dir) / DENSE_NAME, manifest.dense_nbytes)
    return failed + check_dense(dense, manifest, str(Path(pack_dir) / DENSE_NAME))
