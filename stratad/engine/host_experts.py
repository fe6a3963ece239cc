"""The host copy of every expert blob, page-locked so kernels can read it in place."""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable

import torch

from stratad.engine.experts import BlobLayout, copy_expert, moe_layers
from stratad.model.spec import Model

log = logging.getLogger("stratad.engine")
PAGE = mmap.PAGESIZE
CUDA_HOST_REGISTER_PORTABLE = 1


class HostExperts:
    """Every expert blob in one host buffer [L, E, nbytes], page-locked for in-place reads."""

    def __init__(self, model: Model, layout: BlobLayout) -> None:
        spec = model.spec
        self.layout = layout
        # Page-aligned anonymous memory with each blob starting on a page: registration
        # chunks hold whole blobs, so no copy ever spans two registrations.
        self.stride = -(-layout.nbytes // PAGE) * PAGE
        self._map = mmap.mmap(-1, spec.n_layers * spec.n_experts * self.stride)
        arena = torch.frombuffer(self._map, dtype=torch.uint8)
        self.buffer = arena.view(spec.n_layers, spec.n_experts, self.stride)[..., : layout.nbytes]
        self._registered: list[int] = []
        self._pinned = 0
        layers = moe_layers(model)
        t0 = time.monotonic()
        for layer in range(spec.n_layers):
            for e in range(spec.n_experts):
                copy_expert(layers, layer, e, self.buffer[layer, e], layout)
        log.info(
            "experts: %.2f GiB read into RAM in %.1f s",
            len(self._map) / 2**30,
            time.monotonic() - t0,
        )

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
