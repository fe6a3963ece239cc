"""Page-locking host memory: through the GPU runtime, with mlock, or not at all.

A page-locked resident copy is what makes a RAM hit cheap: the GPU's copy engine reads it
directly (cudaHostRegister / hipHostRegister, through torch), and the kernel never swaps it or
moves it under compaction (mlock). Where neither is allowed (no GPU runtime and RLIMIT_MEMLOCK
too small, say) the copy stays in plain RAM, and the caller says so once, loudly.

Lockers work on address ranges so that the pinner can lock a large arena chunk by chunk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stratad.store.sizes import size_text

CAP_IPC_LOCK = 14


class LockError(OSError):
    """A range could not be page-locked."""


class Locker(Protocol):
    name: str  # for the log: "cudaHostRegister", "mlock" or "none"
    locks: bool  # False for the plain-RAM fallback
    gpu_registered: bool  # the GPU's copy engine can read locked ranges asynchronously

    def lock(self, ptr: int, nbytes: int) -> None: ...

    def unlock(self, ptr: int, nbytes: int) -> None: ...


class NoLocker:
    name = "none"
    locks = False
    gpu_registered = False

    def lock(self, ptr: int, nbytes: int) -> None:
        pass

    def unlock(self, ptr: int, nbytes: int) -> None:
        pass


class MlockLocker:
    name = "mlock"
    locks = True
    gpu_registered = False

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._mlock, self._munlock = libc.mlock, libc.munlock
        for f in (self._mlock, self._munlock):
            f.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            f.restype = ctypes.c_int

    def lock(self, ptr: int, nbytes: int) -> None:
        if self._mlock(ptr, nbytes) != 0:
            err = ctypes.get_errno()
            raise LockError(err, f"mlock of {nbytes:,} bytes failed: {os.strerror(err)}")

    def unlock(self, ptr: int, nbytes: int) -> None:
        self._munlock(ptr, nbytes)


class CudaHostLocker:
    """cudaHostRegister (hipHostRegister on ROCm builds of torch) on existing memory."""

    name = "cudaHostRegister"
    locks = True
    gpu_registered = True
    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device and context

    def __init__(self) -> None:
        self._rt = torch.cuda.cudart()

    def lock(self, ptr: int, nbytes: int) -> None:
        rc = int(self._rt.cudaHostRegister(ptr, nbytes, self.PORTABLE))
        if rc != 0:
            raise LockError(rc, f"cudaHostRegister of {nbytes:,} bytes failed (error {rc})")

    def unlock(self, ptr: int, nbytes: int) -> None:
        self._rt.cudaHostUnregister(ptr)


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def has_cap_ipc_lock(status: Path = Path("/proc/self/status")) -> bool:
    """CAP_IPC_LOCK lifts RLIMIT_MEMLOCK (root has it, unless a container drops it)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


@dataclass(frozen=True)
class LockChoice:
    locker: Locker
    warning: str | None  # said once, as a WARNING, when the resident set will not be locked


def choose_locker(
    mode: str,
    device: torch.device,
    planned_bytes: int,
    memlock: tuple[int | None, bool] | None = None,
) -> LockChoice:
    """How the resident set will be locked, for `store.lock` = auto | gpu | mlock | none.

    auto: the GPU runtime when the engine runs on a GPU, else mlock when RLIMIT_MEMLOCK (or
    CAP_IPC_LOCK) allows the whole plan, else plain RAM with a warning. `memlock` is
    (RLIMIT_MEMLOCK or None when unlimited, CAP_IPC_LOCK held); read from the process if None.
    """
    if mode == "none":
        return LockChoice(NoLocker(), None)
    gpu = device.type == "cuda" and torch.cuda.is_available()
    if mode == "gpu" or (mode == "auto" and gpu):
        if gpu:
            return LockChoice(CudaHostLocker(), None)
        return LockChoice(
            NoLocker(),
            "store.lock = gpu but no GPU runtime is available: the resident set stays in plain"
            " RAM (not page-locked)",
        )
    limit, cap = (memlock_limit(), has_cap_ipc_lock()) if memlock is None else memlock
    if limit is not None and not cap and planned_bytes > limit:
        return LockChoice(
            NoLocker(),
            f"cannot page-lock the resident set: RLIMIT_MEMLOCK is {size_text(limit)} and the"
            f" plan holds {size_text(planned_bytes)}; it stays in plain RAM, where the kernel may"
            " swap it out (raise the limit: LimitMEMLOCK=infinity in the unit, `ulimit -l`, or"
            " the container's memlock ulimit)",
        )
    return LockChoice(MlockLocker(), None)
