"""Which experts hold a VRAM slot of an address table: the initial placement and the recency
policy that adapts it.

Pure bookkeeping (no torch): the table (`address_table.py`) asks `touch()` which missed experts
to bring into VRAM and whom they replace, then moves the bytes itself. Each layer owns a fixed
number of slots, so one hot layer cannot starve the others; within a layer the store's eviction
policy (`store.cache_policy`: LRU or LFRU) names the expert that gives way. The initial fill is
a pure function of the profile, so a restart starts from the same place.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from stratad.model.spec import ExpertUnit
from stratad.store.tiers.cache import POLICIES, CachePolicy


@dataclass(frozen=True)
class SlotSettings:
    """How an address table's slots follow the routing."""

    policy: str = "lru"  # the store's eviction policies (`cache.POLICIES`)
    adapt: bool = True  # move recently used experts into VRAM between steps
    moves_per_step: int = 8  # the most copies in flight at once


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
    """Per-layer slot ownership over the store's eviction policies (`stratad.store.tiers.cache`):
    each layer keeps a fixed number of slots, and a miss takes the slot of the expert the
    policy names as victim."""

    def __init__(
        self,
        residents: list[list[int]],
        policy: str = "lru",
        ram: Sequence[Container[int]] | None = None,
    ) -> None:
        """`ram`: each layer's experts with a RAM copy (None: all). A resident without one is
        held for good (evicted, it would have nowhere to be read from but the file); an
        expert without one is never admitted (there is no RAM copy to move in)."""
        self.layers: list[CachePolicy] = []
        self.members: list[set[int]] = []
        self.ram = ram
        for layer, experts in enumerate(residents):
            movable = [e for e in experts if self.in_ram(layer, e)]
            p = POLICIES[policy](len(movable))
            for e in movable:
                p.insert(ExpertUnit(layer, e))
            self.layers.append(p)
            self.members.append(set(experts))

    def in_ram(self, layer: int, expert: int) -> bool:
        return self.ram is None or expert in self.ram[layer]

    def resident(self, layer: int, expert: int) -> bool:
        return expert in self.members[layer]

    def touch(
        self, layer: int, experts: Sequence[int], admit: int | None = None
    ) -> list[tuple[int, int]]:
        """Record one step's routed experts; return (evicted, admitted) pairs to carry out, at
        most `admit` of them (misses past that stay out of VRAM this step)."""
        policy, members = self.layers[layer], self.members[layer]
        moves: list[tuple[int, int]] = []
        for e in experts:
            if e in members:
                if self.in_ram(layer, e):
                    policy.touch(ExpertUnit(layer, e))
                continue
            if (admit is not None and len(moves) >= admit) or not self.in_ram(layer, e):
                continue
            victim = policy.victim()
            if victim is None or victim.expert in experts:  # never evict what this step uses
                continue
            self.replace(layer, victim.expert, e)
            moves.append((victim.expert, e))
        return moves

    def replace(self, layer: int, out: int, into: int) -> None:
        """`into` takes the slot of `out` (also to undo a move the engine could not make)."""
        self.layers[layer].remove(ExpertUnit(layer, out))
        self.members[layer].discard(out)
        self.layers[layer].insert(ExpertUnit(layer, into))
        self.members[layer].add(into)
