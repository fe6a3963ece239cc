"""Host RAM that a GPU kernel reads in place: a tensor whose memory is page-locked host RAM,
seen as a tensor of the GPU (its device pointer, under unified addressing the host address).

Its reads cross PCIe on every use (no copy into VRAM is made), so it suits data too large for
VRAM that a kernel reads once per use with wide loads: a long context's older KV blocks
(`stratad.engine.kv`). The RAM is allocated as usual and registered with the GPU runtime
(`cudaHostRegister` / `hipHostRegister` through torch, as the expert store locks its RAM copy):
the caching host allocator behind `pin_memory=True` would round a large buffer up to a power
of two. The registration ends when the last view of the tensor is gone.
"""

from __future__ import annotations

import torch

from stratad.store.tiers.lock import CudaHostLocker


class _Registered:
    """Owns a host tensor registered with the GPU runtime and shows it to torch as GPU
    memory (`__cuda_array_interface__`, bytes: the interface has no bfloat16)."""

    def __init__(self, host: torch.Tensor, locker: CudaHostLocker) -> None:
        self.host, self.locker = host, locker
        self.ptr, self.nbytes = host.data_ptr(), host.nbytes
        locker.lock(self.ptr, self.nbytes)
        self.__cuda_array_interface__ = {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }

    def __del__(self) -> None:
        self.locker.unlock(self.ptr, self.nbytes)


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor on `device` backed by page-locked host RAM (on a CPU device:
    an ordinary host tensor, which is the same thing there)."""
    if device.type == "cpu" or 0 in shape:  # (nothing to register for an empty one)
        return torch.empty(shape, dtype=dtype, device=device)
    host = torch.empty(shape, dtype=dtype)
    with torch.cuda.device(device):
        flat = torch.as_tensor(_Registered(host, CudaHostLocker()), device=device)
    return flat.view(dtype).view(shape)
