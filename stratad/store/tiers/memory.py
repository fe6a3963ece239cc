"""The two memory tiers: resident RAM (one arena of page-lockable blobs) and VRAM slots.

The third tier, the file, is in `sources.py`. A blob moves between tiers as raw bytes; an
expert's `MLPWeights` are views onto wherever its bytes are (`manifest.blob_view`).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Sequence
from itertools import accumulate

import torch

from stratad.model.spec import ExpertUnit
from stratad.store.tiers.lock import Locker, LockError

PAGE = mmap.PAGESIZE


class ResidentRAM:
    """The plan's resident blobs in one anonymous mapping, slot i at `offsets[i]`.

    Slots are laid out in plan order (hottest first) and every size is a page multiple, so
    that a chunk of whole slots can be locked on its own. A slot serves reads only once the
    pinner has filled it (`ready`); until then its expert comes from the file.
    """

    def __init__(self, units: Sequence[ExpertUnit], sizes: Sequence[int]) -> None:
        if any(s % PAGE for s in sizes):
            raise ValueError(f"resident slot sizes must be multiples of the {PAGE}-byte page")
        self.units = tuple(units)
        self.sizes = tuple(sizes)
        self.offsets: tuple[int, ...] = (0, *accumulate(self.sizes))[: len(self.sizes)]
        self.nbytes = sum(self.sizes)
        self.index = {u: i for i, u in enumerate(self.units)}
        self.ready = [False] * len(self.units)
        # the type codes of a filled slot's parts where its filler named them (ram_form.py)
        self.codes: list[tuple[int, int, int] | None] = [None] * len(self.units)
        self.version = 0  # changes whenever `ready` does (mark_ready, close)
        self._map = mmap.mmap(-1, self.nbytes) if self.nbytes else None
        self.buf = (
            torch.frombuffer(self._map, dtype=torch.uint8)
            if self._map is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        self._locked: list[tuple[int, int, Locker]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.units)

    def slot(self, i: int) -> torch.Tensor:
        return self.buf[self.offsets[i] : self.offsets[i] + self.sizes[i]]

    def view(self, unit: ExpertUnit) -> torch.Tensor | None:
        """The blob's bytes if resident and filled, else None."""
        i = self.index.get(unit)
        return self.slot(i) if i is not None and self.ready[i] else None

    def codes_of(self, unit: ExpertUnit) -> tuple[int, int, int] | None:
        """The type codes its filler named for the unit's slot (None: unnamed, or no slot)."""
        i = self.index.get(unit)
        return None if i is None else self.codes[i]

    def mark_ready(self, i: int, codes: tuple[int, int, int] | None = None) -> None:
        """Slot i is filled (its parts' type `codes`, where the filler named them): it serves
        its expert from now on."""
        self.codes[i] = codes
        self.ready[i] = True
        self.version += 1

    def chunks(self, chunk_bytes: int) -> list[range]:
        """Consecutive slots grouped into chunks of at most `chunk_bytes` (one slot at least)."""
        out: list[range] = []
        start, size = 0, 0
        for i, s in enumerate(self.sizes):
            if size and size + s > chunk_bytes:
                out.append(range(start, i))
                start, size = i, 0
            size += s
        if size:
            out.append(range(start, len(self.sizes)))
        return out

    def span(self, slots: range) -> tuple[int, int]:
        """(address, bytes) of a run of consecutive slots."""
        start = self.offsets[slots.start]
        end = self.offsets[slots.stop - 1] + self.sizes[slots.stop - 1]
        return self.buf.data_ptr() + start, end - start

    def lock(self, slots: range, locker: Locker) -> None:
        ptr, n = self.span(slots)
        locker.lock(ptr, n)  # raises LockError
        with self._lock:
            self._locked.append((ptr, n, locker))

    @property
    def locked_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n, locker in self._locked if locker.locks)

    def close(self) -> None:
        """Unlock, and stop serving. The mapping is not closed here: tensors onto it keep it
        alive (torch.frombuffer holds a reference), so a view handed out earlier never points
        at unmapped memory; it is unmapped when the last of them goes."""
        with self._lock:
            for ptr, n, locker in self._locked:
                with contextlib.suppress(LockError):
                    locker.unlock(ptr, n)
            self._locked.clear()
        self.ready = [False] * len(self.units)
        self.version += 1
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._map = None


class VRAMSlots:
    """`n` equal slots on the cache device; each holds one expert blob of any layer."""

    def __init__(self, n: int, slot_bytes: int, device: torch.device) -> None:
        self.n = n
        self.slot_bytes = slot_bytes
        self.device = device
        self.data = torch.empty((n, slot_bytes), dtype=torch.uint8, device=device)  # [n, bytes]

    def slot(self, i: int) -> torch.Tensor:
        return self.data[i]

    def fill(
        self, i: int, blob: torch.Tensor, nbytes: int, non_blocking: bool = False
    ) -> torch.Tensor:
        """Copy `nbytes` of a host blob into slot i; returns the slot."""
        self.data[i, :nbytes].copy_(blob[:nbytes], non_blocking=non_blocking)
        return self.data[i]
