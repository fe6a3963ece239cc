"""Paced pinning: fill and page-lock the resident set on a background thread.

Page-locking tens of GiB at once stalls the host (faulting and locking every page; about 5 s
for 8 GiB on the H200 machine, during which the rest of the system waits on the memory
manager). Here the arena is locked and filled in chunks of whole blobs (`store.pin_chunk_mib`),
and before each chunk the thread sleeps until the rate cap (`store.pin_rate_gbps`) allows its
bytes, so at any moment the bytes pinned are at most cap x elapsed time. Experts of chunks not
yet done are served from the file meanwhile.

Progress goes to a callback (systemd STATUS= and the control socket use it) and to the log
every `log_interval_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from stratad.model.spec import ExpertUnit
from stratad.store.pack.manifest import PackError
from stratad.store.sizes import GiB, size_text
from stratad.store.tiers.lock import LockChoice, LockError, NoLocker
from stratad.store.tiers.memory import ResidentRAM
from stratad.store.tiers.ram_form import BlobReader, RamForm

log = logging.getLogger("stratad.store")


@dataclass(frozen=True)
class PinSettings:
    chunk_bytes: int
    rate_bps: float  # bytes per second; 0 means unpaced
    log_interval_s: float = 10.0


@dataclass(frozen=True)
class PinProgress:
    pinned_bytes: int
    planned_bytes: int
    chunks_done: int
    chunks_total: int
    elapsed_s: float

    @property
    def fraction(self) -> float:
        return self.pinned_bytes / self.planned_bytes if self.planned_bytes else 1.0

    @property
    def rate_bps(self) -> float:
        return self.pinned_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float:
        left = self.planned_bytes - self.pinned_bytes
        if left <= 0:
            return 0.0
        return left / self.rate_bps if self.rate_bps > 0 else float("inf")

    def describe(self) -> str:
        eta = "?" if self.eta_s == float("inf") else f"{self.eta_s:.0f}s"
        return (
            f"pinning: {self.pinned_bytes / GiB:.2f} / {self.planned_bytes / GiB:.2f} GiB"
            f" ({100 * self.fraction:.0f}%), {self.rate_bps / 1e9:.2f} GB/s, ETA {eta}"
        )


ProgressFn = Callable[[PinProgress], None]


class Pinner:
    """Fills `ram` from `source` chunk by chunk, locking each chunk first.

    A blob that fails its checks (`PackError`) is, by `on_bad_blob`: "skip", named and left
    to the file tier (which raises it on use; `failed` lists it); "stop", the end of pinning,
    kept in `error` for the owner to raise (an engine whose every RAM copy must be there).
    `form`: the form each copy is made in (`ram_form.py`); None: the blob's bytes as read.
    """

    def __init__(
        self,
        ram: ResidentRAM,
        source: BlobReader,
        lock: LockChoice,
        settings: PinSettings,
        on_progress: ProgressFn | None = None,
        on_bad_blob: Literal["skip", "stop"] = "skip",
        form: RamForm | None = None,
    ) -> None:
        self.ram = ram
        self.form = form
        self.on_bad_blob = on_bad_blob
        self.source = source
        self.choice = lock
        self.locker = lock.locker
        self.settings = settings
        self.on_progress = on_progress
        self.chunks = ram.chunks(settings.chunk_bytes)
        self.progress = PinProgress(0, ram.nbytes, 0, len(self.chunks), 0.0)
        self.failed: list[tuple[ExpertUnit, str]] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-pinner", daemon=True)

    def start(self) -> None:
        if not len(self.ram):  # every expert in VRAM (`placement.plan.place`): no thread
            log.info("pinning: the plan keeps no RAM copies, nothing to pin")
            self.done.set()
            return
        s = self.settings
        pace = f"at <= {s.rate_bps / 1e9:.2f} GB/s" if s.rate_bps else "unpaced"
        eta = f", about {self.ram.nbytes / s.rate_bps:.0f}s" if s.rate_bps else ""
        if self.choice.warning:
            log.warning(self.choice.warning)
        log.info(
            "pinning the resident set: %d experts, %s via %s, in %d chunks of <= %s %s%s;"
            " experts not yet pinned are read from the file%s",
            len(self.ram),
            size_text(self.ram.nbytes),
            self.locker.name,
            len(self.chunks),
            size_text(s.chunk_bytes),
            pace,
            eta,
            "" if self.form is None or self.form.as_file else f"; the copies {self.form.name}",
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _lock(self, chunk: range) -> None:
        try:
            self.ram.lock(chunk, self.locker)
        except LockError as e:
            # Once: the rest stays in plain RAM rather than failing chunk after chunk.
            log.warning(
                "cannot page-lock the resident set beyond %s (%s); the rest stays in plain"
                " RAM, where the kernel may swap it out (raise RLIMIT_MEMLOCK:"
                " LimitMEMLOCK=infinity in the unit)",
                size_text(self.ram.locked_bytes),
                e.strerror or e,
            )
            self.locker = NoLocker()

    def _fill(self, chunk: range) -> None:
        for i in chunk:
            unit = self.ram.units[i]
            slot = self.ram.slot(i)
            try:
                if self.form is None:
                    self.source.read_into(unit.layer, unit.expert, slot)
                    codes = None
                else:
                    codes = self.form.fill(self.source, unit, slot)
            except PackError as e:  # named and left to the file tier, which raises it on use
                if self.on_bad_blob == "stop":
                    raise
                log.error(
                    "resident copy of layer %d, expert %d skipped: %s", unit.layer, unit.expert, e
                )
                self.failed.append((unit, str(e)))
                continue
            self.ram.mark_ready(i, codes)

    def _run(self) -> None:
        s = self.settings
        start = last_log = time.monotonic()
        pinned = 0
        try:
            for k, chunk in enumerate(self.chunks):
                nbytes = sum(self.ram.sizes[i] for i in chunk)
                if s.rate_bps:  # pace: a chunk starts once the cap allows its bytes
                    self._stop.wait(start + (pinned + nbytes) / s.rate_bps - time.monotonic())
                if self._stop.is_set():
                    return
                self._lock(chunk)
                self._fill(chunk)
                pinned += nbytes
                now = time.monotonic()
                self.progress = PinProgress(
                    pinned, self.ram.nbytes, k + 1, len(self.chunks), now - start
                )
                if self.on_progress is not None:
                    self.on_progress(self.progress)
                if now - last_log >= s.log_interval_s and pinned < self.ram.nbytes:
                    log.info(self.progress.describe())
                    last_log = now
            elapsed = time.monotonic() - start
            where = (
                f"page-locked ({self.locker.name})"
                if self.locker.locks
                else "in plain RAM (not page-locked)"
            )
            log.info(
                "pinned %d experts (%s) in %.1fs (%.2f GB/s); the resident set is %s",
                len(self.ram) - len(self.failed),
                size_text(pinned),
                elapsed,
                pinned / max(elapsed, 1e-9) / 1e9,
                where,
            )
        except PackError as e:  # on_bad_blob = "stop": the owner raises it
            self.error = e
        except BaseException as e:  # never die silently on a background thread
            self.error = e
            log.exception("pinning the resident set failed; its experts are read from the file")
        finally:
            self.done.set()
