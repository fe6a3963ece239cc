"""The adaptive VRAM expert cache: which expert each slot holds, and whom to evict.

The initial fill is the plan's (deterministic: the profile's hottest first); from then on a
policy adapts the slots to what the running conversation routes to. Routing shows little static
skew but strong recency (a per-layer LRU of 64 experts hit about 67% on a real model), so the
default is LFRU, a segmented LRU: an expert enters on probation and is promoted to the
protected segment when it is used again, and eviction takes the least recently used
probationary expert first. One-off experts of a long prompt therefore do not flush the experts
that every token uses. Policies are chosen by name (`store.cache_policy`).

Experts the plan holds only in VRAM (no RAM copy) are kept for good: evicting one would turn
the coverage the log promised into file reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from stratad.model.spec import ExpertUnit


class CachePolicy(Protocol):
    def insert(self, unit: ExpertUnit) -> None: ...

    def touch(self, unit: ExpertUnit) -> None: ...

    def remove(self, unit: ExpertUnit) -> None: ...

    def victim(self) -> ExpertUnit | None: ...


POLICIES: dict[str, Callable[[int], CachePolicy]] = {}


def register(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        POLICIES[name] = cls
        return cls

    return add


@register("lru")
class LRU:
    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[ExpertUnit, None] = OrderedDict()  # least recent first

    def insert(self, unit: ExpertUnit) -> None:
        self._order[unit] = None

    def touch(self, unit: ExpertUnit) -> None:
        self._order.move_to_end(unit)

    def remove(self, unit: ExpertUnit) -> None:
        del self._order[unit]

    def victim(self) -> ExpertUnit | None:
        return next(iter(self._order), None)


@register("lfru")
class LFRU:
    """Segmented LRU: probation (seen once) and protected (seen again), least recent first."""

    PROTECTED_SHARE = 0.8

    def __init__(self, capacity: int) -> None:
        self.protected_cap = max(1, int(capacity * self.PROTECTED_SHARE))
        self.probation: OrderedDict[ExpertUnit, None] = OrderedDict()
        self.protected: OrderedDict[ExpertUnit, None] = OrderedDict()

    def insert(self, unit: ExpertUnit) -> None:
        self.probation[unit] = None

    def promote(self, unit: ExpertUnit) -> None:
        self.probation.pop(unit, None)
        self.protected[unit] = None
        self.protected.move_to_end(unit)
        if len(self.protected) > self.protected_cap:  # the least recent drops back to probation
            demoted, _ = self.protected.popitem(last=False)
            self.probation[demoted] = None

    def touch(self, unit: ExpertUnit) -> None:
        self.promote(unit)

    def remove(self, unit: ExpertUnit) -> None:
        self.probation.pop(unit, None)
        self.protected.pop(unit, None)

    def victim(self) -> ExpertUnit | None:
        if self.probation:
            return next(iter(self.probation))
        return next(iter(self.protected), None)


class ExpertCache:
    """Slot bookkeeping for `n_slots` VRAM slots under a named policy."""

    def __init__(
        self,
        n_slots: int,
        policy: str = "lfru",
        initial: Sequence[ExpertUnit] = (),
        keep: Iterable[ExpertUnit] = (),
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r} (known: {', '.join(POLICIES)})")
        if len(initial) > n_slots:
            raise ValueError(f"{len(initial)} initial experts for {n_slots} slots")
        self.n_slots = n_slots
        self.keep = frozenset(keep)
        self.policy = POLICIES[policy](n_slots - len(self.keep & set(initial)))
        self.slot_of: dict[ExpertUnit, int] = {}
        self.unit_in: list[ExpertUnit | None] = [None] * n_slots
        self.evictions = 0
        self._free = list(range(n_slots - 1, len(initial) - 1, -1))  # popped lowest first
        # Coldest first, so that the hottest ends most recent; under LFRU the profile's
        # experts start protected (the profile has seen them used), the coldest on probation.
        for slot, unit in reversed(list(enumerate(initial))):
            self._place(unit, slot)
            if unit not in self.keep:
                self.policy.insert(unit)
                if isinstance(self.policy, LFRU):
                    self.policy.promote(unit)

    def _place(self, unit: ExpertUnit, slot: int) -> None:
        self.slot_of[unit] = slot
        self.unit_in[slot] = unit

    def lookup(self, unit: ExpertUnit) -> int | None:
        """The slot holding `unit` (a hit, which the policy records), or None."""
        slot = self.slot_of.get(unit)
        if slot is not None and unit not in self.keep:
            self.policy.touch(unit)
        return slot

    def admit(self, unit: ExpertUnit) -> tuple[int | None, ExpertUnit | None]:
        """A slot for `unit`: a free one, else the policy's victim's. (None, None) if every
        slot is kept. Returns (slot, evicted expert)."""
        if unit in self.slot_of:
            return self.slot_of[unit], None
        free = self._free.pop() if self._free else None
        evicted = None
        if free is None:
            evicted = self.policy.victim()
            if evicted is None:
                return None, None
            self.policy.remove(evicted)
            free = self.slot_of.pop(evicted)
            self.evictions += 1
        self._place(unit, free)
        self.policy.insert(unit)
        return free, evicted
