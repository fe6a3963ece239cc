"""Between decode steps: count the routing and hits, move recently used experts into VRAM.

Each step's routed ids are copied to the host without waiting (`step`), and are accounted
while the *next* step runs on the GPU, so the bookkeeping never holds the GPU idle. The
per-layer policy (`SlotPolicy`) names whom each miss replaces, at most `moves_per_step`
copies being in flight. A move repoints the victim at its RAM copy (ordered after the steps
already queued, which may still read its slot), copies the admitted expert into the slot on
the side stream, and repoints the table at the slot only once that copy has finished
(`apply`, before the next step; it never waits). Hits are counted against the residency the
step itself read, so the deferral does not blur them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stratad.engine.offload import OffloadForward


class SlotMoves:
    def __init__(self, engine: OffloadForward) -> None:
        self.engine = engine
        self.pending: list[tuple[int, int, int, torch.cuda.Event | None]] = []  # copies in flight
        # the last step, not yet accounted: its ids on the host, their copy's event, and the
        # experts that step found in VRAM
        self._last: tuple[torch.Tensor, torch.cuda.Event | None, list[frozenset[int]]] | None
        self._last = None

    def step(self, ids: torch.Tensor) -> None:
        """After a decode step is queued: count its routing ([L, k] on the device), start
        copying its ids to the host, and account the step before it (finished by now, or
        finishing while this one runs)."""
        e = self.engine
        own = e.route_counts[e.layer_ids.start : e.layer_ids.stop]
        own.scatter_add_(1, ids.long(), torch.ones_like(ids, dtype=torch.int64))
        resident = [frozenset(e.slot_of[layer]) for layer in e.layer_ids]
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            copied: torch.cuda.Event | None = event
        else:
            host, copied = ids.clone(), None
        last, self._last = self._last, (host, copied, resident)
        if last is not None:
            self._account(*last)

    def flush(self) -> None:
        """Account the last step now (waits for it)."""
        last, self._last = self._last, None
        if last is not None:
            self._account(*last)

    def _account(
        self, ids: torch.Tensor, copied: torch.cuda.Event | None, resident: list[frozenset[int]]
    ) -> None:
        """Count hits and plan VRAM moves for the experts one step used ([L, k] on the host)."""
        e = self.engine
        if copied is not None:
            copied.synchronize()
        repoint: list[tuple[int, int, int]] = []
        for layer, experts, vram in zip(e.layer_ids, ids.tolist(), resident, strict=True):
            e.lookups += len(experts)
            e.hits += sum(1 for x in experts if x in vram)
            if e.config.adapt and e.n_slots:
                room = max(0, e.config.moves_per_step - len(self.pending))
                for victim, admitted in e.policy.touch(layer, experts, admit=room):
                    if (base := self._start(layer, victim, admitted)) is not None:
                        repoint.append((layer, victim, base))
        # the victims read their RAM copy from the next step queued on (ordered after the
        # steps already queued)
        self._write_table(repoint)

    def _start(self, layer: int, victim: int, admitted: int) -> int | None:
        """Start copying `admitted` into the victim's slot; the victim's RAM address for the
        table, or None if the victim's own copy is still in flight (the move is undone)."""
        e = self.engine
        if victim not in e.slot_of[layer]:
            e.policy.replace(layer, admitted, victim)  # keep policy and table in step
            return None
        e.moves += 1
        s = e.slot_of[layer].pop(victim)
        if e.side is None:
            e.slots[s].copy_(e.host.blob(layer, admitted))
            self.pending.append((layer, admitted, s, None))
        else:
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(e.side):
                e.side.wait_event(ready)  # no kernel queued so far still reads the slot
                e.slots[s].copy_(e.host.blob(layer, admitted), non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self.pending.append((layer, admitted, s, done))
        return int(e.host.blob(layer, victim).data_ptr())

    def apply(self) -> None:
        """Repoint the table at slots whose copies have finished (never waits)."""
        e = self.engine
        keep: list[tuple[int, int, int, torch.cuda.Event | None]] = []
        repoint: list[tuple[int, int, int]] = []
        for layer, x, s, done in self.pending:
            if done is not None and not done.query():
                keep.append((layer, x, s, done))
                continue
            repoint.append((layer, x, int(e.slots[s].data_ptr())))
            e.slot_of[layer][x] = s
        self.pending = keep
        self._write_table(repoint)

    def _write_table(self, rows: list[tuple[int, int, int]]) -> None:
        """Point (layer, expert) at the blob at each base address: one small copy and one
        indexed write for all of a step's changes."""
        if not rows:
            return
        e = self.engine
        r = torch.tensor(rows, dtype=torch.int64)
        addrs = r[:, 2:] + e._off[None, :]  # [n, 3]: gate, up, down
        packed = torch.cat([r[:, :2], addrs], dim=1)
        if e.device.type == "cuda":  # from page-locked memory, so the host does not wait
            packed = packed.pin_memory()
        packed = packed.to(e.device, non_blocking=True)
        e.table[packed[:, 0], packed[:, 1]] = packed[:, 2:]
