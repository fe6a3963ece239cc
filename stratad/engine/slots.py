"""Which experts hold a VRAM slot: the initial placement and the recency policy that adapts it.

Pure bookkeeping (no torch): the engine asks `admissions()` which missed experts to bring
into VRAM and whom they replace, then moves the bytes itself. Each layer owns a fixed
number of slots, so one hot layer cannot starve the others, and within a layer the least
recently used resident expert gives way. The initial fill is a pure function of the
profile, so a restart starts from the same place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def initial_residents(
    n_layers: int,
    n_experts: int,
    slots_per_layer: int,
    profile: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """The experts of each layer that start in VRAM: the hottest by profile, ties by index."""
    out = []
    for layer in range(n_layers):
        counts = profile[layer] if profile is not None else [0] * n_experts
        ranked = sorted(range(n_experts), key=lambda e: (-counts[e], e))
        out.append(sorted(ranked[:slots_per_layer]))
    return out


class SlotPolicy:
    """Per-layer LRU over a fixed number of slots; misses seen twice are admitted."""

    def __init__(self, residents: list[list[int]], admit_after: int = 1) -> None:
        self.lru: list[OrderedDict[int, None]] = [
            OrderedDict((e, None) for e in layer) for layer in residents
        ]
        self.admit_after = admit_after
        self.misses: list[dict[int, int]] = [{} for _ in residents]

    def resident(self, layer: int, expert: int) -> bool:
        return expert in self.lru[layer]

    def touch(self, layer: int, experts: Sequence[int]) -> list[tuple[int, int]]:
        """Record one step's routed experts; return (evicted, admitted) pairs to carry out."""
        lru, misses = self.lru[layer], self.misses[layer]
        moves: list[tuple[int, int]] = []
        for e in experts:
            if e in lru:
                lru.move_to_end(e)
                continue
            misses[e] = misses.get(e, 0) + 1
            if misses[e] >= self.admit_after and lru:
                victim, _ = lru.popitem(last=False)
                if victim in experts:  # never evict what this step uses; try again later
                    lru[victim] = None
                    lru.move_to_end(victim, last=False)
                    continue
                del misses[e]
                lru[e] = None
                moves.append((victim, e))
        return moves
