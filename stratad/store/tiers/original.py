"""The model file a pack was made from, as the second copy of its experts.

A blob of experts.bin that fails its checksum is read again from the original (the GGUF file
or Hugging Face directory the manifest records, when it is still there at the recorded size
and still holds the pack's experts), laid out as the pack's blob and used only if that blob's
CRC-32 is the manifest's; the first such read of a blob names it in one WARNING.

Where the original is not there, `repair_source` checks every blob before the store serves and
refuses a damaged pack (`DamagedPack`, exit 65: restarting would not mend it), so that a
request never meets an expert it cannot read.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from stratad.model.spec import ExpertUnit
from stratad.store.pack.manifest import Manifest, PackError
from stratad.store.pack.write import PackSource, encode_blob, open_pack_source, source_nbytes
from stratad.store.sizes import size_text
from stratad.store.tiers.sources import BlobCorrupt, PackExperts

log = logging.getLogger("stratad.store")


class DamagedPack(PackError):
    """A pack whose blobs fail their checksums and whose original is not there to mend them."""


class OriginalExperts:
    """The experts of a pack's original, each read as the pack's blob and checked against the
    manifest's CRC-32 (a `BlobCorrupt` when it differs: the original changed since)."""

    def __init__(self, manifest: Manifest, source: PackSource) -> None:
        self.manifest = manifest
        self.source = source
        self.label = manifest.source
        self.damaged: set[ExpertUnit] = set()  # blobs of the pack read from here instead

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """Blob (layer, expert) from the original into `out` (CPU uint8)."""
        blob = self.manifest.blob(layer, expert)
        crc = encode_blob(self.source.expert(layer, expert), self.manifest.layouts[layer],
                          out.numpy().data)  # fmt: skip
        if crc != blob.crc32:
            raise BlobCorrupt(
                f"{self.label}: the expert of layer {layer}, expert {expert} read from the model"
                f" file the pack was made from does not match the manifest either (crc32"
                f" {crc:08x}, the manifest says {blob.crc32:08x}): re-create the pack with"
                " `stratactl pack`",
                layer,
                expert,
            )

    def mend(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """Read a blob the pack holds damaged; the first time, say so once."""
        self.read_into(layer, expert, out)
        unit = ExpertUnit(layer, expert)
        if unit not in self.damaged:
            self.damaged.add(unit)
            log.warning(
                "the blob of layer %d, expert %d fails its checksum in the pack; it is read"
                " from the model file it was made from (%s) instead; re-create the pack with"
                " `stratactl pack`",
                layer,
                expert,
                self.label,
            )


def open_original(manifest: Manifest) -> tuple[OriginalExperts | None, str]:
    """The pack's original, or None and the reason it cannot stand in for the pack."""
    path = Path(manifest.source)
    if not path.is_absolute():
        return None, f"the manifest names it by a relative path, {manifest.source!r}"
    try:
        size = source_nbytes(path)
    except OSError as e:
        return None, f"{path}: {e.strerror}"
    if manifest.source_nbytes == 0:
        return None, f"{path}: the manifest does not record its size (a pack of an older Strata)"
    if size != manifest.source_nbytes:
        return None, f"{path}: {size:,} bytes, the pack was made from {manifest.source_nbytes:,}"
    if not os.access(path, os.R_OK):
        return None, f"{path}: not readable"
    try:
        original = OriginalExperts(manifest, open_pack_source(path))
        probe = torch.empty(manifest.layouts[0].nbytes, dtype=torch.uint8)
        original.read_into(0, 0, probe)  # the same model, not just the same size
    except BlobCorrupt:
        return None, f"{path}: does not hold the pack's experts (layer 0, expert 0 differs)"
    except Exception as e:  # noqa: BLE001 - any reason it cannot be read is a reason
        return None, f"{path}: cannot read it: {e}"
    return original, ""


def check_every_blob(source: PackExperts) -> list[BlobCorrupt]:
    """Read and verify every blob of the pack (each one that passes is not checked again)."""
    manifest = source.manifest
    buf = torch.empty(max(lay.nbytes for lay in manifest.layouts), dtype=torch.uint8)
    failed = []
    for b in manifest.blobs:
        try:
            source.read_into(b.layer, b.expert, buf)
        except BlobCorrupt as e:
            failed.append(e)
    return failed


def repair_source(source: PackExperts) -> OriginalExperts | None:
    """Where a damaged blob of `source` will be read from: its original when that is there;
    else None once every blob has passed its check (`DamagedPack` when one fails)."""
    original, why = open_original(source.manifest)
    if original is not None:
        # a fact about the fallback, not a finding: a blob that fails says so when it is read
        log.info(
            "each expert blob's checksum is checked when it is first read; should one fail, the"
            " model file the pack was made from (%s) stands in for it",
            original.label,
        )
        return original
    total = source.manifest.experts_nbytes
    log.info(
        "the model file the pack was made from is not there to mend a damaged blob (%s):"
        " checking every blob's checksum before serving (%s)",
        why,
        size_text(total),
    )
    t0 = time.monotonic()
    failed = check_every_blob(source)
    if failed:
        names = ", ".join(f"layer {e.layer} expert {e.expert}" for e in failed[:8])
        more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
        raise DamagedPack(
            f"{source.path}: {len(failed)} expert blob(s) fail their checksum ({names}{more}),"
            f" and the model file the pack was made from cannot stand in for them ({why}):"
            " re-create the pack with `stratactl pack`"
        )
    log.info("every expert blob passed its checksum (%.1f s)", time.monotonic() - t0)
    return None
