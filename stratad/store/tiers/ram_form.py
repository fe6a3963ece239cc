"""The form the resident RAM tier keeps its copies in: a mode object the store and the pinner
ask for each copy's size, filling and reading.

- `AsInFile`: each copy is the expert's blob as the source gives it (the GGUF blocks, the
  layout of `ExpertLayout`): every engine reads it, and the offload engine copies it to VRAM.
- A kernel's own layout (the cpu engine's rows interleaved in eights,
  `stratad/engine/reference/interleaved_ram.py`): made once at pinning, read only by the
  one-call layers through `ExpertStore.in_place`, which hands each part's type code with it.

A part's type code is the C kernels' (`kernels/cpu/experts.py`): the GGUF type's number, or
that with the interleaved flag set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from stratad.model.spec import ExpertUnit
from stratad.store.pack.manifest import ExpertBytes, ExpertLayout, expert_bytes

Codes = tuple[int, int, int]  # gate, up and down's type codes


class BlobReader(Protocol):
    """What filling a copy needs of a source (an `ExpertSource` is one)."""

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None: ...


class RamForm(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def as_file(self) -> bool:
        """Whether a copy holds the blob's own bytes (any reader may view it as the file's)."""
        ...

    def stride(self, layer: int) -> int:
        """Bytes of one copy of an expert of `layer` in RAM: a multiple of the page."""
        ...

    def fill(self, source: BlobReader, unit: ExpertUnit, slot: torch.Tensor) -> Codes:
        """Read the expert from `source` into `slot` (`stride` bytes); the codes of what the
        slot's parts hold."""
        ...

    def parts(self, layer: int, slot: torch.Tensor) -> ExpertBytes:
        """Gate, up and down's bytes inside a filled slot (views)."""
        ...


def file_codes(layout: ExpertLayout) -> Codes:
    """The type codes of a blob's parts as the file holds them."""
    g, u, d = (int(t.qt) for t in layout.projections)
    return g, u, d


class AsInFile:
    """Copies byte for byte as the source's blobs (the default form)."""

    name = "as in the file"
    as_file = True

    def __init__(self, layouts: Sequence[ExpertLayout]) -> None:
        self.layouts = tuple(layouts)

    def stride(self, layer: int) -> int:
        return self.layouts[layer].stride

    def fill(self, source: BlobReader, unit: ExpertUnit, slot: torch.Tensor) -> Codes:
        source.read_into(unit.layer, unit.expert, slot)
        return file_codes(self.layouts[unit.layer])

    def parts(self, layer: int, slot: torch.Tensor) -> ExpertBytes:
        return expert_bytes(slot, self.layouts[layer])
