"""The GPU engine's RAM tier: the store's arena (`store.tiers.ResidentRAM`), filled and
page-locked by the store's paced pinner (`store.pinning.Pinner`) on its background thread, in
the kernels' layout; the experts without a RAM copy are read from the model file on use
(`file_read`), counted as file reads.

Every blob comes through the store's `ExpertSource` (a pack's experts.bin, whose checksums
are verified on each blob's first read, or the model file read in place) and is turned into
the kernels' layout on the way (`KernelBlobs`). The kernels read RAM copies in place, so the
engine waits for the pinner (`wait`) before it builds its address table; it loads its dense
weights meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from stratad.engine.offload.experts import ExpertLayouts, from_stored
from stratad.model.spec import ExpertUnit
from stratad.store.tiers.lock import CudaHostLocker, LockChoice, NoLocker
from stratad.store.tiers.memory import PAGE, ResidentRAM
from stratad.store.tiers.pinning import Pinner, PinSettings, ProgressFn
from stratad.store.tiers.sources import ExpertSource

UNPACED = PinSettings(chunk_bytes=1 << 30, rate_bps=0.0)


class PinError(RuntimeError):
    """The RAM tier could not be page-locked for the GPU, which reads it in place."""


class KernelBlobs:
    """`source` read in the kernels' layout: each blob converted as it is read (any thread:
    the pinner and the engine's file reads each get their own scratch)."""

    def __init__(self, source: ExpertSource, layouts: ExpertLayouts) -> None:
        self.source, self.layouts = source, layouts
        self._raw_bytes = max(lay.nbytes for lay in source.layouts)
        self._local = threading.local()

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        raw = getattr(self._local, "raw", None)
        if raw is None:
            raw = self._local.raw = torch.empty(self._raw_bytes, dtype=torch.uint8)
        self.source.read_into(layer, expert, raw)  # verified there
        from_stored(raw, self.source.layouts[layer], out, self.layouts[layer])


def default_lock(device: torch.device) -> LockChoice:
    """Registered with the GPU runtime on a GPU (its kernels read the copies in place)."""
    return LockChoice(CudaHostLocker() if device.type == "cuda" else NoLocker(), None)


class HostExperts:
    """The RAM copies of `ram` (each layer's experts with one; None: every expert), one
    page-strided row each, `buffer` [rows, nbytes]. Pinning starts at construction; `wait`
    returns once every row is filled and locked, and raises the first blob that failed its
    checks (`BlobCorrupt`, naming it) or a `PinError`."""

    def __init__(
        self,
        source: ExpertSource,
        layouts: ExpertLayouts,
        ram: Sequence[Sequence[int]] | None = None,
        lock: LockChoice | None = None,
        settings: PinSettings = UNPACED,
        on_progress: ProgressFn | None = None,
    ) -> None:
        self.source, self.layouts = source, layouts
        self.blobs = KernelBlobs(source, layouts)
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
        sizes = [-(-layouts.copy_bytes(u.layer) // PAGE) * PAGE for u in units]
        self.ram = ResidentRAM(units, sizes)
        self._rows = [self.ram.slot(i)[: layouts.copy_bytes(u.layer)] for i, u in enumerate(units)]
        # the byte range of every RAM copy: a kernel that finds an address in it reads RAM
        base = self.ram.buf.data_ptr()
        self.span = (base, base + self.ram.nbytes)
        self.file_reads = self.file_bytes = 0
        self.pinner = Pinner(self.ram, self.blobs, lock or LockChoice(NoLocker(), None),
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
        """Read a blob from the model file into out [>= its copy bytes] (the kernels' layout);
        returns the part of `out` it fills."""
        self.blobs.read_into(layer, expert, out)
        self.file_reads += 1
        self.file_bytes += self.layouts[layer].nbytes
        return out[: self.layouts.copy_bytes(layer)]

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
