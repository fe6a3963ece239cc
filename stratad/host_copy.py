"""Copies between the host and the device that do not wait for the work queued before them.

A copy between a GPU and pageable host memory waits for everything queued on the stream so
far (a tensor's `tolist()`, `cpu()`, or `torch.tensor(values, device=...)`): the host then
cannot prepare a step while the one before it runs. Here the host side is page-locked and
the copy is queued on the current stream without a wait:

- `HostCopy`: a device tensor's copy to the host, queued now and read later; `wait()` waits
  for that copy alone, not for the work queued on the stream after it. On the CPU the tensor
  is copied at once (its storage may be reused, as a captured graph's outputs are).
- `to_device`: host values as a tensor on the device, ordered before the work queued after
  it. PyTorch's page-locked allocator keeps the host buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostCopy:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor.clone()
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> torch.Tensor:
        """The copy on the host, once it has landed."""
        if self._done is not None:
            self._done.synchronize()
        return self._host


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[float]],
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # fmt: skip
    """`values` as a tensor of `dtype` on `device`, without a wait on a GPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
