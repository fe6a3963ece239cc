"""Between decode steps: count the routing and hits, move recently used experts into VRAM.

After each step the routed ids come to the host once; the per-layer policy (`SlotPolicy`)
names whom each miss replaces, at most `moves_per_step` copies being in flight. A move
repoints the victim at its RAM copy (ordered after the step that may still read its slot),
copies the admitted expert into the slot on the side stream, and repoints the table at the
slot only once that copy has finished (`apply`, before the next step; it never waits).
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

    def account(self, ids: torch.Tensor) -> None:
        """Count routing and plan VRAM moves for the experts this step used ([L, k])."""
        e = self.engine
        own = e.route_counts[e.layer_ids.start : e.layer_ids.stop]
        own.scatter_add_(1, ids.long(), torch.ones_like(ids, dtype=torch.int64))
        host_ids = ids.cpu().tolist()  # the step's one synchronisation (with the sampler's)
        repoint: list[tuple[int, int, int]] = []
        for layer, experts in zip(e.layer_ids, host_ids, strict=True):
            e.lookups += len(experts)
            e.hits += sum(1 for x in experts if x in e.slot_of[layer])
            if e.config.adapt and e.n_slots:
                room = max(0, e.config.moves_per_step - len(self.pending))
                for victim, admitted in e.policy.touch(layer, experts, admit=room):
                    if (base := self._start(layer, victim, admitted)) is not None:
                        repoint.append((layer, victim, base))
        # the victims read their RAM copy from the next step on (ordered after this step)
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
            e.slots[s].copy_(e.host.buffer[layer, admitted])
            self.pending.append((layer, admitted, s, None))
        else:
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(e.side):
                e.side.wait_event(ready)  # no kernel queued so far still reads the slot
                e.slots[s].copy_(e.host.buffer[layer, admitted], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self.pending.append((layer, admitted, s, done))
        return int(e.host.buffer[layer, victim].data_ptr())

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
        packed = torch.cat([r[:, :2], addrs], dim=1).to(e.device, non_blocking=False)
        e.table[packed[:, 0], packed[:, 1]] = packed[:, 2:]
