"""The file tier: where an expert's bytes come from when no faster tier holds them.

`PackExperts` reads blobs of a pack's experts.bin with os.pread (no mapping: a read is an
explicit, counted event, and the page cache is the kernel's business) and verifies each blob's
CRC-32 the first time it is read. `ModelExperts` reads experts straight from a loaded model's
stacked tensors, e.g. a GGUF's mapping, without packing (GGUF carries no checksums).

Both count every read and its bytes; the counters are safe to bump from the pinning thread.
"""

from __future__ import annotations

import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stratad.model.archs import ARCHS
from stratad.model.spec import Model
from stratad.store.pack.manifest import (
    EXPERTS_NAME,
    ExpertBytes,
    ExpertLayout,
    Manifest,
    PackError,
    check_blobs,
    encoded,
    expert_layout,
    read_manifest,
)


class BlobCorrupt(PackError):
    """A blob whose bytes do not match the manifest's checksum."""

    def __init__(self, message: str, layer: int, expert: int) -> None:
        super().__init__(message)
        self.layer = layer
        self.expert = expert


@dataclass(frozen=True)
class ReadCounts:
    reads: int
    bytes: int


class ReadStats:
    """Reads and bytes read, counted under a lock (the engine and the pinner both read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads = 0
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._reads += 1
            self._bytes += nbytes

    def snapshot(self) -> ReadCounts:
        with self._lock:
            return ReadCounts(self._reads, self._bytes)


class ExpertSource(Protocol):
    label: str  # for messages: the file experts are read from
    kind: str  # what that file is, for messages: "pack file" or "model file"
    n_layers: int  # the model's MoE layers (past any leading dense ones): the grid's rows
    n_experts: int
    layouts: tuple[ExpertLayout, ...]  # per layer
    stats: ReadStats

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """Copy blob (layer, expert) into `out` (CPU uint8, at least the blob's bytes)."""
        ...

    def mapped(self, layer: int, expert: int) -> ExpertBytes | None:
        """The expert's gate, up and down bytes where the source holds them mapped (no copy;
        not counted: the store counts what it serves from them), else None: `read_into` it."""
        ...

    def drop_cache(self, layer: int, expert: int) -> None:
        """Ask the kernel to forget the blob's cached pages (for a cold-read measurement)."""
        ...

    def close(self) -> None: ...


class PackExperts:
    """The experts of a pack directory, read with pread and verified on first read."""

    def __init__(self, pack_dir: Path, manifest: Manifest | None = None) -> None:
        self.manifest = manifest or read_manifest(pack_dir)
        self.path = Path(pack_dir) / EXPERTS_NAME
        self.label = str(self.path)
        self.kind = "pack file"
        spec = self.manifest.spec
        self.n_layers, self.n_experts = spec.n_layers, spec.n_experts
        self.layouts = self.manifest.layouts
        self.stats = ReadStats()
        self._verified = bytearray(self.n_layers * self.n_experts)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise PackError(f"{self.path}: cannot open: {e.strerror}") from None
        size = os.fstat(self._fd).st_size
        try:
            if size != self.manifest.experts_nbytes:
                raise PackError(
                    f"{self.path}: {size:,} bytes, the manifest says"
                    f" {self.manifest.experts_nbytes:,} (truncated or replaced?)"
                )
            check_blobs(self.manifest, size, str(self.path))
        except PackError:
            os.close(self._fd)
            raise

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        blob = self.manifest.blob(layer, expert)
        view = out.numpy().data[: blob.nbytes]
        if len(view) < blob.nbytes:
            raise ValueError(f"a buffer of {len(view)} bytes cannot hold a {blob.nbytes}-byte blob")
        got = 0
        while got < blob.nbytes:
            n = os.preadv(self._fd, [view[got:]], blob.offset + got)
            if n == 0:
                raise PackError(
                    f"{self.path}: unexpected end of file in the blob of layer"
                    f" {layer}, expert {expert}"
                )
            got += n
        self.stats.add(blob.nbytes)
        i = layer * self.n_experts + expert
        if self._verified[i]:
            return
        crc = zlib.crc32(view)
        if crc != blob.crc32:
            raise BlobCorrupt(
                f"{self.path}: the blob of layer {layer}, expert {expert} (offset"
                f" {blob.offset:,}, {blob.nbytes:,} bytes) fails its checksum (crc32 {crc:08x},"
                f" the manifest says {blob.crc32:08x}): the pack is damaged; re-create it with"
                " `stratactl pack`",
                layer,
                expert,
            )
        self._verified[i] = 1

    def mapped(self, layer: int, expert: int) -> None:
        return None  # read and verified, never mapped

    def drop_cache(self, layer: int, expert: int) -> None:
        blob = self.manifest.blob(layer, expert)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, blob.offset, blob.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ModelExperts:
    """The experts of a loaded model, read from its stacked tensors (a GGUF read in place).
    Its layers are the model's MoE layers, from 0 (past a model's leading dense layers)."""

    def __init__(self, model: Model) -> None:
        spec = model.spec
        arch = ARCHS[spec.arch]
        self.label = str(model.source)
        self.kind = "model file"  # a GGUF read in place, or a Hugging Face directory's files
        self.n_layers, self.n_experts = len(spec.moe_layers), spec.n_experts
        self._stacks = [arch.layer(model, i).mlp.experts for i in spec.moe_layers]  # type: ignore[union-attr]
        self.layouts = tuple(expert_layout(s.expert(0)) for s in self._stacks)
        self.stats = ReadStats()

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        w = self._stacks[layer].expert(expert)
        layout = self.layouts[layer]
        for t, place in zip((w.gate, w.up, w.down), layout.projections, strict=True):
            out[place.offset : place.offset + place.nbytes].copy_(encoded(t))
        self.stats.add(layout.nbytes)

    def mapped(self, layer: int, expert: int) -> ExpertBytes:
        """Views onto the stacks (the model's mapping of the file, for a GGUF)."""
        w = self._stacks[layer].expert(expert)
        return encoded(w.gate), encoded(w.up), encoded(w.down)

    def drop_cache(self, layer: int, expert: int) -> None:
        pass  # a mapping's pages are shared with the engine's other views: leave them

    def close(self) -> None:
        pass
