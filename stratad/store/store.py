"""The expert store: one `get(layer, expert)` over three tiers, fastest first.

VRAM slot (the adaptive cache) -> resident RAM copy (once pinned) -> the file (a blob that
fails its checksum there read from the pack's original, `repair`, when there is one). A miss is
admitted into VRAM when `admit_on_miss` (the cache policy picks the victim), so that the slots
follow what the conversation routes to. Every answer is counted by the tier it came from.

`get` returns `MLPWeights` of QTensor views onto the tier's bytes. A view onto a VRAM slot is
valid until a later `get` evicts that slot: use it (the reference engine dequantizes it)
before asking for more experts than there are slots. `use_experts` hands several experts' bytes
to one call and admits the misses after it (the cpu engine: a step's experts in one kernel
call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import torch

from stratad.model.spec import ExpertUnit
from stratad.model.weights import MLPWeights
from stratad.store.pack.manifest import ExpertBytes, blob_view, expert_bytes
from stratad.store.placement.bandwidth import Bandwidths
from stratad.store.placement.plan import RamBudget, ResidencyPlan
from stratad.store.tiers.cache import ExpertCache
from stratad.store.tiers.lock import LockChoice
from stratad.store.tiers.lookups import Lookups
from stratad.store.tiers.memory import ResidentRAM, VRAMSlots
from stratad.store.tiers.original import OriginalExperts
from stratad.store.tiers.pinning import Pinner, PinSettings, ProgressFn
from stratad.store.tiers.ram_form import AsInFile, Codes, RamForm, file_codes
from stratad.store.tiers.sources import BlobCorrupt, ExpertSource


class InPlace(NamedTuple):
    """Where a kernel reads one expert as it lies (`ExpertStore.in_place`)."""

    parts: ExpertBytes  # gate, up and down's bytes
    tier: str  # "ram" or "file"
    codes: Codes  # the parts' type codes (`tiers/ram_form.py`)


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters for the control socket and /metrics."""

    plan_hash: str
    vram_hits: int
    ram_hits: int
    file_hits: int
    evictions: int
    file_reads: int  # every read of the file tier, pinning and start-up fills included
    file_bytes: int
    pinned_bytes: int
    planned_ram_bytes: int
    vram_slots: int


class ExpertStore:
    def __init__(
        self,
        source: ExpertSource,
        plan: ResidencyPlan,
        *,
        cache_device: torch.device,
        lock: LockChoice,
        pin: PinSettings,
        policy: str = "lfru",
        admit_on_miss: bool = True,
        on_pin_progress: ProgressFn | None = None,
        counts: Sequence[int] = (),
        bandwidths: Bandwidths | None = None,
        budget: RamBudget | None = None,
        degraded: bool = False,
        repair: OriginalExperts | None = None,
        ram_form: RamForm | None = None,
    ) -> None:
        """`ram_form`: the form the RAM copies are made in (`tiers/ram_form.py`; default: as
        in the file). Another form's copies are read only through `in_place`."""
        self.source = source
        self.repair = repair
        self.plan = plan
        # How the plan came about, for the control socket's views: the profile's layer-major
        # counts, the bandwidths measured at start, the RAM budget, and whether admission
        # had to run a smaller plan.
        self.counts = tuple(counts)
        self.bandwidths = bandwidths
        self.budget = budget
        self.degraded = degraded
        self.layouts = source.layouts
        self.admit_on_miss = admit_on_miss
        self.ram_form: RamForm = ram_form or AsInFile(self.layouts)
        if not self.ram_form.as_file and plan.vram:
            raise ValueError(f"RAM copies {self.ram_form.name} cannot fill VRAM slots")
        self.ram = ResidentRAM(plan.ram, [self.ram_form.stride(u.layer) for u in plan.ram])
        self._ram_slots: list[list[int]] = [[] for _ in range(source.n_layers)]
        for i, u in enumerate(plan.ram):
            self._ram_slots[u.layer].append(i)
        self.slots = VRAMSlots(len(plan.vram), plan.slot_bytes, cache_device)
        self.cache = ExpertCache(len(plan.vram), policy, initial=plan.vram, keep=plan.vram_only)
        self.pinner = Pinner(self.ram, source, lock, pin, on_pin_progress, form=self.ram_form)
        self.lookups = Lookups()  # experts served, by tier

    def start(self) -> None:
        """Fill the VRAM slots with the plan's initial experts, then start pinning."""
        staging = torch.empty(self.plan.slot_bytes, dtype=torch.uint8)
        for slot, unit in enumerate(self.plan.vram):
            self._read_file(unit.layer, unit.expert, staging)
            self.slots.fill(slot, staging, self.layouts[unit.layer].nbytes)
        self.pinner.start()

    def get(self, layer: int, expert: int) -> MLPWeights:
        blob, tier = self._held(layer, expert)
        if blob is None:
            blob = self._read(layer, expert)
        if tier != "vram":
            blob = self._admit(layer, expert, blob, tier)
        return blob_view(blob, self.layouts[layer])

    def use_experts(
        self, layer: int, experts: Sequence[int], use: Callable[[list[ExpertBytes]], None]
    ) -> None:
        """`use` the experts' bytes (gate, up and down: uint8 in `layouts[layer]`'s types),
        all of them at once: each from the fastest tier holding it, counted as `get` counts.
        A file-tier expert is the source's mapping where it has one and no slot would take
        it in (a GGUF read in place: no copy, the page cache is that tier), else read. The
        misses are admitted after `use` returns, so that no admission refills a slot `use`
        still reads (the cpu engine hands a step's experts to its kernels in one call)."""
        layout = self.layouts[layer]
        admits = self.admit_on_miss and self.slots.n > 0
        got: list[tuple[ExpertBytes, torch.Tensor | None, str]] = []
        for e in experts:
            blob, tier = self._held(layer, e)
            mapped = None if blob is not None or admits else self.source.mapped(layer, e)
            if mapped is not None:
                self.count(layer, ["file"])
                got.append((mapped, None, tier))
                continue
            blob = self._read(layer, e) if blob is None else blob
            got.append((expert_bytes(blob, layout), blob, tier))
        use([parts for parts, _, _ in got])
        for e, (_, blob, tier) in zip(experts, got, strict=True):
            if tier != "vram" and blob is not None:
                self._admit(layer, e, blob, tier)

    def in_place(self, layer: int) -> list[InPlace] | None:
        """Every expert of `layer` where a kernel can read it as it lies, with its tier and its
        parts' type codes: the RAM copy once pinned (in `ram_form`), else the source's
        mapping; None where some expert cannot be (VRAM slots to look up and admit into, or a
        source read with copies: a pack). Not counted: `count` what a step used. Valid until
        the next pinned chunk (`ready_in`) or `close`."""
        if self.slots.n:
            return None
        out: list[InPlace] = []
        in_file = file_codes(self.layouts[layer])
        for e in range(self.source.n_experts):
            unit = ExpertUnit(layer, e)
            blob = self.ram.view(unit)
            if blob is not None:
                codes = self.ram.codes_of(unit) or in_file
                out.append(InPlace(self.ram_form.parts(layer, blob), "ram", codes))
                continue
            mapped = self.source.mapped(layer, e)
            if mapped is None:
                return None
            out.append(InPlace(mapped, "file", in_file))
        return out

    def ready_version(self) -> int:
        """Changes whenever a RAM copy starts (or stops) serving: while it holds, `in_place`
        and `ready_in` answer as before."""
        return self.ram.version

    def ready_in(self, layer: int) -> int:
        """How many of `layer`'s RAM copies are pinned (and serve) now."""
        return sum(self.ram.ready[i] for i in self._ram_slots[layer])

    def count(self, layer: int, tiers: Sequence[str]) -> None:
        """Count experts of `layer` as served, one from each of `tiers` (in_place's, for those
        a step used; a file-tier answer counts as a read of its bytes)."""
        for tier in tiers:
            self.lookups.add(tier)
            if tier == "file":
                self.source.stats.add(self.layouts[layer].nbytes)

    def forget_lookups(self) -> None:
        """Start the lookups by tier over at zero: those so far were no request's (the daemon's
        warm-up, which runs while pinning may still be under way and so finds experts in the
        file that the plan keeps in RAM). The file reads stay counted: they were made."""
        self.lookups.clear()

    def _held(self, layer: int, expert: int) -> tuple[torch.Tensor | None, str]:
        """The expert's VRAM slot or RAM copy (counted by tier), or (None, "file")."""
        unit = ExpertUnit(layer, expert)
        slot = self.cache.lookup(unit)
        if slot is not None:
            self.lookups.add("vram")
            return self.slots.slot(slot), "vram"
        if not self.ram_form.as_file:
            raise RuntimeError(f"the RAM copies are {self.ram_form.name}: only in_place reads"
                               " them")  # fmt: skip
        blob = self.ram.view(unit)
        if blob is not None:
            self.lookups.add("ram")
            return blob, "ram"
        return None, "file"

    def _read(self, layer: int, expert: int) -> torch.Tensor:
        """The file tier (counted): the expert's blob read into a new buffer."""
        blob = torch.empty(self.layouts[layer].stride, dtype=torch.uint8)
        self._read_file(layer, expert, blob)
        self.lookups.add("file")
        return blob

    def _admit(self, layer: int, expert: int, blob: torch.Tensor, tier: str) -> torch.Tensor:
        """A missed expert into a VRAM slot when `admit_on_miss` (the policy picks the
        victim): the slot's bytes, or `blob` when it stays out."""
        if not (self.admit_on_miss and self.slots.n):
            return blob
        slot, _ = self.cache.admit(ExpertUnit(layer, expert))
        if slot is None:
            return blob
        async_copy = tier == "ram" and self.pinner.locker.gpu_registered
        self.slots.fill(slot, blob, self.layouts[layer].nbytes, non_blocking=async_copy)
        return self.slots.slot(slot)

    def _read_file(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """The file tier: the blob from the source, or from the original when it is damaged."""
        if self.repair is not None and ExpertUnit(layer, expert) in self.repair.damaged:
            self.repair.read_into(layer, expert, out)
            return
        try:
            self.source.read_into(layer, expert, out)
        except BlobCorrupt:
            if self.repair is None:
                raise
            self.repair.mend(layer, expert, out)

    def stats(self) -> StoreStats:
        reads = self.source.stats.snapshot()
        return StoreStats(
            plan_hash=self.plan.hash,
            vram_hits=self.lookups.vram,
            ram_hits=self.lookups.ram,
            file_hits=self.lookups.file,
            evictions=self.cache.evictions,
            file_reads=reads.reads,
            file_bytes=reads.bytes,
            pinned_bytes=self.pinner.progress.pinned_bytes,
            planned_ram_bytes=self.ram.nbytes,
            vram_slots=self.slots.n,
        )

    def close(self) -> None:
        self.pinner.stop()
        self.ram.close()
        self.source.close()
