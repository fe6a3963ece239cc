"""The host copies of the expert blobs the plan keeps in RAM, page-locked so kernels can read
them in place; the others stay in the model file and are read from it on use (`file_read`),
counted as file reads.

Every blob comes through the store's `ExpertSource` (a pack's experts.bin, whose checksums
are verified on each blob's first read, or the model file read in place) and is turned into
the kernels' layout on the way (`experts.from_stored`)."""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable, Sequence

import torch

from stratad.engine.experts import BlobLayout, from_stored
from stratad.store.sources import ExpertSource

log = logging.getLogger("stratad.engine")
PAGE = mmap.PAGESIZE
CUDA_HOST_REGISTER_PORTABLE = 1


class HostExperts:
    """The RAM tier: one host buffer [rows, nbytes] holding the blobs of `ram` (each layer's
    experts with a RAM copy; None: every expert), page-locked for in-place reads. The others
    are read from `source` into a caller's buffer (`file_read`). A blob that fails its
    checksum raises `BlobCorrupt`, naming it."""

    def __init__(
        self, source: ExpertSource, layout: BlobLayout, ram: Sequence[Sequence[int]] | None = None
    ) -> None:
        self.source, self.layout = source, layout
        every = range(source.n_experts)
        self.row_of: list[dict[int, int]] = []
        n = 0
        for layer in range(source.n_layers):
            experts = sorted(ram[layer]) if ram is not None else every
            self.row_of.append({e: n + i for i, e in enumerate(experts)})
            n += len(experts)
        total = source.n_layers * source.n_experts
        self.complete = n == total
        # Page-aligned anonymous memory with each blob starting on a page: registration
        # chunks hold whole blobs, so no copy ever spans two registrations.
        self.stride = -(-layout.nbytes // PAGE) * PAGE
        self._map = mmap.mmap(-1, max(n, 1) * self.stride)
        arena = torch.frombuffer(self._map, dtype=torch.uint8)
        self.buffer = arena.view(max(n, 1), self.stride)[:, : layout.nbytes]
        self._registered: list[int] = []
        self._pinned = 0
        self._raw = torch.empty(max(lay.nbytes for lay in source.layouts), dtype=torch.uint8)
        self.file_reads = self.file_bytes = 0
        t0 = time.monotonic()
        for layer, rows in enumerate(self.row_of):
            for e, row in rows.items():
                self._copy(layer, e, self.buffer[row])
        log.info(
            "experts: %.2f GiB read into RAM from %s in %.1f s (%d of %d blobs; the rest are"
            " read from the file on use)", n * self.stride / 2**30, source.label,
            time.monotonic() - t0, n, total,
        )  # fmt: skip

    def _copy(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """Read a blob from the source (verified there) into out [nbytes], kernel layout."""
        self.source.read_into(layer, expert, self._raw)
        from_stored(self._raw, self.source.layouts[layer], out, self.layout)

    def has(self, layer: int, expert: int) -> bool:
        return expert in self.row_of[layer]

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """The RAM copy [nbytes] of a blob the plan keeps in RAM."""
        return self.buffer[self.row_of[layer][expert]]

    def file_read(self, layer: int, expert: int, out: torch.Tensor) -> torch.Tensor:
        """Read a blob from the model file into out [nbytes] (the kernels' layout)."""
        self._copy(layer, expert, out)
        self.file_reads += 1
        self.file_bytes += self.layout.nbytes
        return out

    def read(self, layer: int, expert: int, out: torch.Tensor) -> torch.Tensor:
        """The blob from RAM, else read from the file into `out`."""
        if self.has(layer, expert):
            return self.blob(layer, expert)
        return self.file_read(layer, expert, out)

    @property
    def registered(self) -> bool:
        return bool(self._registered)

    @property
    def nbytes(self) -> int:
        return len(self._map)

    @property
    def pinned_bytes(self) -> int:
        return self._pinned

    def pin(
        self,
        chunk_bytes: int = 1 << 30,
        rate_bytes_s: float = 0.0,
        on_progress: Callable[[int, int, float, tuple[int, int]], None] | None = None,
        portable: bool = False,
    ) -> None:
        """Register the buffer with the GPU runtime (mapped into the device's address space:
        kernels may read it in place), in chunks of whole blobs, at most `rate_bytes_s` on
        average (0: no cap) so that a large pin does not stall the host."""
        cudart = torch.cuda.cudart()
        base, total = self.buffer.data_ptr(), len(self._map)
        step = max(1, chunk_bytes // self.stride) * self.stride
        n_chunks = -(-total // step)
        t0 = time.monotonic()
        for k, off in enumerate(range(0, total, step)):
            n = min(step, total - off)
            # portable: page-locked for every GPU of the process (a pipeline over two GPUs)
            flags = CUDA_HOST_REGISTER_PORTABLE if portable else 0
            torch.cuda.check_error(cudart.cudaHostRegister(base + off, n, flags))
            self._registered.append(base + off)
            self._pinned = off + n
            if rate_bytes_s > 0:  # pace: never ahead of the capped average rate
                ahead = self._pinned / rate_bytes_s - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            if on_progress is not None:
                on_progress(self._pinned, total, time.monotonic() - t0, (k + 1, n_chunks))
        log.info("experts: %.2f GiB page-locked in %.1f s", total / 2**30, time.monotonic() - t0)

    def close(self) -> None:
        """Unregister (before the memory goes back to the system)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
            self._pinned = 0

    def __del__(self) -> None:
        self.close()
