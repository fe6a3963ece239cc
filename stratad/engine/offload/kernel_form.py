"""The GPU engine's blobs as the store's RAM rows hold them (`stratad.store.tiers.rows.RowForm`):
each expert read from the store's source in the layout the store writes (`ExpertLayout`: GGUF
blocks) and turned into the kernels' on the way (`experts.from_stored`: Q4_0 split, Q6_K split
where the table says so)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from stratad.engine.offload.experts import ExpertLayouts, from_stored
from stratad.store.pack.manifest import ExpertLayout
from stratad.store.tiers.ram_form import BlobReader


class KernelForm:
    def __init__(self, stored: Sequence[ExpertLayout], layouts: ExpertLayouts) -> None:
        self.stored, self.layouts = tuple(stored), layouts
        self._raw_bytes = max(lay.nbytes for lay in self.stored)
        # each reading thread's scratch (the pinner's, the engine's file reads)
        self._local = threading.local()

    def nbytes(self, layer: int) -> int:
        return self.layouts[layer].nbytes

    def copy_bytes(self, layer: int) -> int:
        return self.layouts.copy_bytes(layer)

    @property
    def slot_bytes(self) -> int:
        return self.layouts.slot_bytes

    def offsets(self) -> torch.Tensor:
        return self.layouts.offsets()

    def read(self, source: BlobReader, layer: int, expert: int, out: torch.Tensor) -> None:
        raw = getattr(self._local, "raw", None)
        if raw is None:
            raw = self._local.raw = torch.empty(self._raw_bytes, dtype=torch.uint8)
        source.read_into(layer, expert, raw)  # verified there
        from_stored(raw, self.stored[layer], out, self.layouts[layer])
