"""The RAM tier of a runner whose kernels read experts by address (the GPU engine): one
page-strided row per expert the plan keeps in RAM, in the store's arena (`memory.ResidentRAM`),
filled and page-locked by the store's paced pinner (`pinning.Pinner`) on its background thread.

Each row holds its blob in the runner's `RowForm` (the GPU engine's: its kernels' blob layout,
`stratad.engine.offload.kernel_form`), made on the way from the store's `ExpertSource` (a pack's
experts.bin, whose checksums are verified on each blob's first read, or the model file read in
place). An expert without a row is read from the source on use (`file_read`), counted. The
kernels read the rows in place, so the runner waits for the pinner (`wait`) before it builds its
address table (`address_table.py`); it loads its dense weights meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from stratad.model.spec import ExpertUnit
from stratad.store.tiers.lock import CudaHostLocker, LockChoice, NoLocker
from stratad.store.tiers.memory import PAGE, ResidentRAM
from stratad.store.tiers.pinning import Pinner, PinSettings, ProgressFn
from stratad.store.tiers.ram_form import BlobReader
from stratad.store.tiers.sources import ExpertSource

UNPACED = PinSettings(chunk_bytes=1 << 30, rate_bps=0.0)


class RowForm(Protocol):
    """The form a runner's kernels read a blob in."""

    def nbytes(self, layer: int) -> int:
        """A blob of `layer`'s own bytes (what a read of the file counts)."""
        ...

    def copy_bytes(self, layer: int) -> int:
        """What moving one blob of `layer` copies (its bytes rounded up as the copies need)."""
        ...

    @property
    def slot_bytes(self) -> int:
        """A row that takes any layer's blob (a VRAM slot, a bounce row): the largest copy."""
        ...

    def offsets(self) -> torch.Tensor:
        """[L, 3] int64: each layer's (gate, up, down) byte offsets inside its blobs."""
        ...

    def read(self, source: BlobReader, layer: int, expert: int, out: torch.Tensor) -> None:
        """Read the blob from `source` into out [>= copy_bytes] in this form (any thread)."""
        ...


class PinError(RuntimeError):
    """The RAM tier could not be page-locked for the GPU, which reads it in place."""


class _InForm:
    """`source` read in `form` (what the pinner fills the rows with)."""

    def __init__(self, source: ExpertSource, form: RowForm) -> None:
        self.source, self.form = source, form

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        self.form.read(self.source, layer, expert, out)


def gpu_lock(device: torch.device) -> LockChoice:
    """Registered with the GPU runtime on a GPU (its kernels read the rows in place)."""
    return LockChoice(CudaHostLocker() if device.type == "cuda" else NoLocker(), None)


class PinnedRows:
    """The RAM copies of `ram` (each layer's experts with one; None: every expert), one
    page-strided row each, in `form`. Pinning starts at construction; `wait` returns once
    every row is filled and locked, and raises the first blob that failed its checks
    (`BlobCorrupt`, naming it) or a `PinError`."""

    def __init__(
        self,
        source: ExpertSource,
        form: RowForm,
        ram: Sequence[Sequence[int]] | None = None,
        lock: LockChoice | None = None,
        settings: PinSettings = UNPACED,
        on_progress: ProgressFn | None = None,
    ) -> None:
        self.source, self.form = source, form
        every = range(source.n_experts)
        units = [
            ExpertUnit(layer, e)
            for layer in range(source.n_layers)
            for e in (sorted(ram[layer]) if ram is not None else every)
        ]
        self.row_of: list[dict[int, int]] = [{} for _ in range(source.n_layers)]
        for row, u in enumerate(units):
            self.row_of[u.layer][u.expert] = row
        self.complete = len(units) == source.n_layers * source.n_experts
        # each row starts on a page and takes its layer's size, as the store's plan counts it:
        # a pinned chunk holds whole rows, so no copy ever spans two registrations
        sizes = [-(-form.copy_bytes(u.layer) // PAGE) * PAGE for u in units]
        self.ram = ResidentRAM(units, sizes)
        self._rows = [self.ram.slot(i)[: form.copy_bytes(u.layer)] for i, u in enumerate(units)]
        # the byte range of every RAM copy: a kernel that finds an address in it reads RAM
        base = self.ram.buf.data_ptr()
        self.span = (base, base + self.ram.nbytes)
        self.file_reads = self.file_bytes = 0  # reads on use (the pinner's are the source's)
        self.pinner = Pinner(self.ram, _InForm(source, form), lock or LockChoice(NoLocker(), None),
                             settings, on_progress, on_bad_blob="stop")  # fmt: skip
        self.pinner.start()
        self._checked = False

    def wait(self) -> None:
        """Until the pinner is done; raises what it could not do."""
        self.pinner.wait()
        if self._checked:
            return
        if self.pinner.error is not None:
            raise self.pinner.error
        if self.gpu_registered and self.ram.locked_bytes < self.ram.nbytes:
            raise PinError(
                f"only {self.ram.locked_bytes:,} of {self.ram.nbytes:,} bytes of the experts'"
                " RAM copies could be registered with the GPU, whose kernels read them in place"
            )
        self._checked = True

    def has(self, layer: int, expert: int) -> bool:
        return expert in self.row_of[layer]

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """The RAM copy [copy bytes of its layer] of a blob the plan keeps in RAM."""
        return self._rows[self.row_of[layer][expert]]

    def file_read(self, layer: int, expert: int, out: torch.Tensor) -> torch.Tensor:
        """Read a blob from the source into out [>= its copy bytes] (in the rows' form);
        returns the part of `out` it fills."""
        self.form.read(self.source, layer, expert, out)
        self.file_reads += 1
        self.file_bytes += self.form.nbytes(layer)
        return out[: self.form.copy_bytes(layer)]

    def read(self, layer: int, expert: int, out: torch.Tensor) -> torch.Tensor:
        """The blob from RAM, else read from the file into `out`."""
        if self.has(layer, expert):
            return self.blob(layer, expert)
        return self.file_read(layer, expert, out)

    @property
    def gpu_registered(self) -> bool:
        """Whether the copies are registered with the GPU runtime (its kernels read them)."""
        return self.pinner.choice.locker.gpu_registered

    @property
    def nbytes(self) -> int:
        return self.ram.nbytes

    @property
    def pinned_bytes(self) -> int:
        return self.pinner.progress.pinned_bytes

    def close(self) -> None:
        """Stop pinning and unlock (before the memory goes back to the system)."""
        self.pinner.stop()
        self.ram.close()

    def __del__(self) -> None:
        self.close()
