"""A runner's experts on one device, for kernels that read them by address (the GPU engine):
the VRAM slots, the per-(layer, expert) address table, the eviction policy, the moves between
decode steps and the counters. The store hands one out per device (`AddressedStore`).

Each layer owns the slots its initial residents fill. The table says where each expert's
blob is for the kernels: its VRAM slot, its page-locked RAM copy (`rows.py`), or (an expert
only the file holds) the file tier's bounce rows (`file_rows.py`, read before a layer's
kernels: `read_file_misses`).

Between decode steps (`step`): each step's routed ids are copied to the host without
waiting, and are accounted while the *next* step runs on the GPU, so the bookkeeping never
holds the GPU idle. The per-layer policy (`SlotPolicy`) names whom each miss replaces, at
most `moves_per_step` copies being in flight. A move repoints the victim at its RAM copy
(ordered after the steps already queued, which may still read its slot), copies the
admitted expert into the slot on the side stream, and repoints the table at the slot only
once that copy has finished (`apply`, before the next step; it never waits). Hits are
counted against the residency the step itself read, so the deferral does not blur them.
"""

from __future__ import annotations

import logging

import torch

from stratad.host_copy import HostCopy
from stratad.store.tiers.file_rows import FileRows
from stratad.store.tiers.lookups import Lookups
from stratad.store.tiers.rows import PinnedRows
from stratad.store.tiers.slots import SlotPolicy, SlotSettings

log = logging.getLogger("stratad.store")


class AddressTable:
    def __init__(
        self,
        ram: PinnedRows,
        layers: range,
        residents: list[list[int]],
        device: torch.device,
        settings: SlotSettings,
        file_rows: int = 0,
    ) -> None:
        """`ram`: the RAM rows (their form says a slot's bytes and where the parts lie in a
        blob); `residents`: each layer's experts that start in VRAM (only `layers` are this
        table's); `file_rows`: the most experts only the file holds that one layer's kernels
        may read at once (0: none can be routed)."""
        n_layers, n_experts = len(ram.row_of), ram.source.n_experts
        self.ram, self.layers, self.device, self.settings = ram, layers, device, settings
        self.slot_bytes = nbytes = ram.form.slot_bytes
        residents = [r if layer in layers else [] for layer, r in enumerate(residents)]
        self.n_slots = sum(len(r) for r in residents)
        self.slots = torch.empty((max(self.n_slots, 1), nbytes), dtype=torch.uint8, device=device)
        # a slot's expert without a RAM copy stays in VRAM; one only the file holds is never
        # admitted (there is no RAM copy to move in from)
        self.policy = SlotPolicy(residents, settings.policy, ram=ram.row_of)
        self.offsets = ram.form.offsets()  # [L, 3]
        self.files = FileRows(ram, file_rows, nbytes, self.offsets, device)
        unread_address = self.files.address  # where experts only the file holds point until read
        self.slot_of: list[dict[int, int]] = []
        table = torch.empty((n_layers, n_experts, 3), dtype=torch.int64)
        scratch = torch.empty(nbytes, dtype=torch.uint8)
        s = 0
        for layer in range(n_layers):
            slot_of = {}
            for e in range(n_experts):
                base = ram.blob(layer, e).data_ptr() if ram.has(layer, e) else unread_address
                table[layer, e] = base + self.offsets[layer]
            for e in residents[layer]:
                blob = ram.read(layer, e, scratch)
                self.slots[s][: blob.numel()].copy_(blob)
                table[layer, e] = self.slots[s].data_ptr() + self.offsets[layer]
                slot_of[e] = s
                s += 1
            self.slot_of.append(slot_of)
        self.table = table.to(device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.route_counts = torch.zeros((n_layers, n_experts), dtype=torch.int64, device=device)
        self.lookups = Lookups()  # the routed experts of decode steps, by tier
        self.moves = 0
        self.pending: list[tuple[int, int, int, torch.cuda.Event | None]] = []  # copies in flight
        # the last step, not yet accounted: its ids on the host, their copy's event, and the
        # experts that step found in VRAM
        self._last: tuple[HostCopy, list[frozenset[int]]] | None = None
        log.info(
            "expert cache: %d of %d experts in VRAM (%.2f GiB)",
            self.n_slots, len(layers) * n_experts, self.n_slots * nbytes / 2**30,
        )  # fmt: skip

    @property
    def complete(self) -> bool:
        """Every expert of these layers holds a slot: nothing to miss."""
        return self.n_slots == len(self.layers) * self.table.shape[1]

    @property
    def hit_rate(self) -> float:
        """VRAM hits over routed experts of the decode steps so far (accounts the last)."""
        self.flush()
        return self.lookups.hit_rate

    @property
    def reads_file(self) -> bool:
        """Whether a step may route to an expert only the file holds (the host then reads it
        before the layer's kernels: such a step cannot replay as a captured graph)."""
        return self.files.enabled

    def read_file_misses(self, layer: int, ids: torch.Tensor) -> None:
        """Before `layer`'s kernels: read its routed experts [T, k] that only the file holds
        into the bounce rows and point the table at them (waits for the routing)."""
        self.files.before(layer, ids, self.slot_of[layer], self.table)

    def forget_lookups(self) -> None:
        """Count the lookups by tier from zero (the last step's too)."""
        self.flush()
        self.lookups.clear()

    def step(self, ids: torch.Tensor) -> None:
        """After a decode step is queued: count its routing ([layers, n] on the device, n
        routed experts per layer), start copying its ids to the host, and account the step
        before it (finished by now, or finishing while this one runs)."""
        own = self.route_counts[self.layers.start : self.layers.stop]
        own.scatter_add_(1, ids.long(), torch.ones_like(ids, dtype=torch.int64))
        if self.complete:  # nothing can miss or move: the counts need no copy of the ids
            self.lookups.vram += ids.numel()
            return
        resident = [frozenset(self.slot_of[layer]) for layer in self.layers]
        last, self._last = self._last, (HostCopy(ids), resident)
        if last is not None:
            self._account(*last)

    def flush(self) -> None:
        """Account the last step now (waits for it)."""
        last, self._last = self._last, None
        if last is not None:
            self._account(*last)

    def _account(self, copied: HostCopy, resident: list[frozenset[int]]) -> None:
        """Count hits and plan VRAM moves for the experts one step used (on the host)."""
        ids = copied.wait()
        repoint: list[tuple[int, int, int]] = []
        cfg = self.settings
        for layer, experts, vram in zip(self.layers, ids.tolist(), resident, strict=True):
            hits = sum(1 for x in experts if x in vram)
            held = self.ram.row_of[layer]
            files = sum(1 for x in experts if x not in vram and x not in held)
            self.lookups.vram += hits
            self.lookups.file += files
            self.lookups.ram += len(experts) - hits - files
            if cfg.adapt and self.n_slots:
                room = max(0, cfg.moves_per_step - len(self.pending))
                # each expert once, in the order of first use: the policy's work is per
                # expert, not per token (a batch of 32 routes 256 ids a layer, ~110 experts)
                used = list(dict.fromkeys(experts))
                for victim, admitted in self.policy.touch(layer, used, admit=room):
                    if (base := self._start(layer, victim, admitted)) is not None:
                        repoint.append((layer, victim, base))
        # the victims read their RAM copy from the next step queued on (ordered after the
        # steps already queued)
        self._write(repoint)

    def _start(self, layer: int, victim: int, admitted: int) -> int | None:
        """Start copying `admitted` into the victim's slot; the victim's RAM address for the
        table, or None if the victim's own copy is still in flight (the move is undone)."""
        if victim not in self.slot_of[layer]:
            self.policy.replace(layer, admitted, victim)  # keep policy and table in step
            return None
        self.moves += 1
        s = self.slot_of[layer].pop(victim)
        blob = self.ram.blob(layer, admitted)
        if self.side is None:
            self.slots[s][: blob.numel()].copy_(blob)
            self.pending.append((layer, admitted, s, None))
        else:
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)  # no kernel queued so far still reads the slot
                self.slots[s][: blob.numel()].copy_(blob, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self.pending.append((layer, admitted, s, done))
        return int(self.ram.blob(layer, victim).data_ptr())

    def apply(self) -> None:
        """Repoint the table at slots whose copies have finished (never waits)."""
        keep: list[tuple[int, int, int, torch.cuda.Event | None]] = []
        repoint: list[tuple[int, int, int]] = []
        for layer, x, s, done in self.pending:
            if done is not None and not done.query():
                keep.append((layer, x, s, done))
                continue
            repoint.append((layer, x, int(self.slots[s].data_ptr())))
            self.slot_of[layer][x] = s
        self.pending = keep
        self._write(repoint)

    def _write(self, rows: list[tuple[int, int, int]]) -> None:
        """Point (layer, expert) at the blob at each base address: one small copy and one
        indexed write for all of a step's changes."""
        if not rows:
            return
        r = torch.tensor(rows, dtype=torch.int64)
        packed = torch.cat([r[:, :2], r[:, 2:] + self.offsets[r[:, 0]]], dim=1)
        if self.device.type == "cuda":  # from page-locked memory, so the host does not wait
            packed = packed.pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        self.table[packed[:, 0], packed[:, 1]] = packed[:, 2:]
