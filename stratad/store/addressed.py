"""The expert store of a runner whose kernels read experts by address (the GPU engine).

The same store as `store.py`'s for the control socket and /metrics (`plan`, `stats()`, the
pinner, the lookups by tier), over other tiers: the RAM copies are rows in the runner's own
form (`tiers/rows.py`), and each device the runner computes on gets an address table
(`address_table`; `tiers/address_table.py`: its VRAM slots, their policy, the moves and the
counters), which the kernels read instead of asking for experts one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stratad.store.placement.bandwidth import Bandwidths
from stratad.store.placement.plan import RamBudget, ResidencyPlan
from stratad.store.store import StoreStats
from stratad.store.tiers.address_table import AddressTable
from stratad.store.tiers.lookups import Lookups
from stratad.store.tiers.pinning import Pinner
from stratad.store.tiers.rows import PinnedRows
from stratad.store.tiers.slots import SlotSettings


class AddressedStore:
    def __init__(
        self,
        rows: PinnedRows,
        plan: ResidencyPlan | None = None,
        *,
        counts: Sequence[int] = (),
        bandwidths: Bandwidths | None = None,
        budget: RamBudget | None = None,
        degraded: bool = False,
    ) -> None:
        """`plan`: the residency plan the rows were made from (None: a runner built without
        one, every expert in RAM; it has no `stats`). The rest, as `ExpertStore` takes them,
        say how the plan came about for the control socket's views."""
        self.rows, self.plan = rows, plan
        self.source = rows.source
        self.layouts = rows.source.layouts  # the blobs as the file holds them
        self.counts, self.bandwidths, self.budget = tuple(counts), bandwidths, budget
        self.degraded = degraded  # admission ran a smaller plan than configured
        self.tables: list[AddressTable] = []

    def address_table(
        self, layers: range, residents: list[list[int]], device: torch.device,
        settings: SlotSettings, file_rows: int = 0,
    ) -> AddressTable:  # fmt: skip
        """The experts of `layers` on `device` (`AddressTable`'s arguments); the store counts
        its lookups with the others'."""
        table = AddressTable(self.rows, layers, residents, device, settings, file_rows)
        self.tables.append(table)
        return table

    @property
    def pinner(self) -> Pinner:
        """The RAM tier's pinner (the control socket follows its progress)."""
        return self.rows.pinner

    @property
    def lookups(self) -> Lookups:
        """The routed experts of decode steps by tier, every table's, as accounted so far (a
        table accounts a step while the next runs; any thread may read them)."""
        seen = [t.lookups for t in self.tables]
        return Lookups(sum(s.vram for s in seen), sum(s.ram for s in seen),
                       sum(s.file for s in seen))  # fmt: skip

    def forget_lookups(self) -> None:
        """Start the lookups by tier over at zero (as `ExpertStore.forget_lookups`; on the
        runner's thread, between steps)."""
        for t in self.tables:
            t.forget_lookups()

    def stats(self) -> StoreStats:
        if self.plan is None:
            raise RuntimeError("a store built without a residency plan has no stats")
        seen, reads = self.lookups, self.source.stats.snapshot()
        return StoreStats(
            plan_hash=self.plan.hash, vram_hits=seen.vram, ram_hits=seen.ram,
            file_hits=seen.file, evictions=sum(t.moves for t in self.tables),
            file_reads=reads.reads, file_bytes=reads.bytes,
            pinned_bytes=self.rows.pinned_bytes, planned_ram_bytes=self.rows.nbytes,
            vram_slots=sum(t.n_slots for t in self.tables),
        )  # fmt: skip

    def close(self) -> None:
        self.rows.close()
