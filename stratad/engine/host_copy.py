"""A device tensor's copy to the host, queued now and read later.

On a GPU the copy goes into page-locked memory without waiting, on the current stream, and
an event marks its end: `wait()` waits for that copy alone, not for the work queued on the
stream after it (a tensor's `tolist()` or `cpu()` there would wait for everything queued so
far). On the CPU the tensor is copied at once (its storage may be reused, as a captured
graph's outputs are).
"""

from __future__ import annotations

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
