"""`stratactl check`'s pack checks: a pack named by `store.pack` or given as `model.path`.

The manifest is read and the blob list checked against experts.bin (each (layer, expert)
once, in order, aligned, inside the file), as the daemon checks it when it opens the pack.
`--verify` also reads every blob and checks its CRC-32, with progress on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from stratactl.client import gib
from stratad.config import Config

MANIFEST = "manifest.json"


def pack_dir(config: Config) -> Path | None:
    """The pack the daemon would read experts from: `store.pack`, else `model.path` when
    that is a pack directory."""
    if config.store.pack:
        return Path(config.store.pack)
    path = Path(config.model.path) if config.model.path else None
    return path if path is not None and (path / MANIFEST).is_file() else None


def pack_header(path: Path) -> tuple[str, int, int, int]:
    """(arch, layers, experts per layer, bytes) of a pack, from its manifest."""
    from stratad.store.pack.manifest import read_manifest  # imports torch

    m = read_manifest(path)
    return m.spec.arch, m.spec.n_layers, m.spec.n_experts, m.experts_nbytes + m.dense_nbytes


def check_pack(pack: Path, verify: bool) -> tuple[Literal["ok", "fail"], str]:
    """(status, detail) of the pack's check."""
    from stratad.store.pack.manifest import EXPERTS_NAME, PackError, check_blobs, read_manifest
    from stratad.store.pack.verify import verify_checksums

    try:
        manifest = read_manifest(pack)
        size = (pack / EXPERTS_NAME).stat().st_size
        if size != manifest.experts_nbytes:
            raise PackError(f"{pack / EXPERTS_NAME}: {size:,} bytes, the manifest says"
                            f" {manifest.experts_nbytes:,} (truncated or replaced?)")  # fmt: skip
        check_blobs(manifest, size, str(pack / EXPERTS_NAME))
    except (PackError, OSError) as e:
        return "fail", str(e)
    what = (f"{pack}: format {manifest.format_version}, {len(manifest.blobs)} expert blobs,"
            f" {gib(size)}")  # fmt: skip
    if not verify:
        return "ok", what + " (checksums are checked on first read; --verify reads them all)"

    def progress(done: int, total: int, elapsed: float) -> None:
        print(f"check: verified {done} of {total} blobs ({elapsed:.0f} s)", file=sys.stderr)

    failed = verify_checksums(pack, manifest, progress)
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return "fail", f"{len(failed)} blobs or tensors fail their checksum: {failed[0]}{more}"
    return "ok", what + ", every checksum verified"
