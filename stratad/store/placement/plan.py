"""Deterministic sizing: which experts start in VRAM, which keep a copy in RAM, which stay in
the file. Pure functions of their arguments; nothing here reads the machine's state.

The upstream engine sized its resident set from MemAvailable at start, so the same binary on
the same box landed anywhere between 75% and 100% coverage across restarts (and 1,810 vs 2,583
prompt tokens/s with it). Here the RAM budget is a configured number, or MemTotal minus named
reserves, and the plan is a function of (blob sizes, profile, budgets): same inputs, same plan,
same hash.

Placement (`place`, the one function that decides it, for the daemon, a layer split and
`stratactl check` alike): rank every expert hottest first (profile count, ties by expert then
layer so that equal experts spread over the layers). Each device (`Stage`: the layers it runs
and its VRAM slots) takes the first experts of the ranking that belong to its own layers. RAM
then takes a prefix of the others, hottest first, and with what is left a prefix of the VRAM
ones (a copy that survives their eviction from the adaptive cache). Prefixes, not best-fit,
so that a larger budget only ever adds experts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from stratad.model.spec import ExpertUnit
from stratad.store.sizes import GiB

Tier = Literal["vram", "ram", "file"]


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on. Sequences are layer-major: index = layer * n_experts + e."""

    n_layers: int
    n_experts: int
    blob_bytes: tuple[int, ...]  # each blob's size in RAM (its 4 KiB-aligned stride)
    counts: tuple[int, ...]  # routing counts from the expert profile (all zero: no profile)
    vram_budget: int  # bytes of VRAM for expert slots
    ram_budget: int  # bytes of RAM for resident copies

    def __post_init__(self) -> None:
        n = self.n_layers * self.n_experts
        if len(self.blob_bytes) != n or len(self.counts) != n:
            raise ValueError(
                f"{len(self.blob_bytes)} sizes and {len(self.counts)} counts for"
                f" {self.n_layers} x {self.n_experts} experts"
            )
        if self.vram_budget < 0 or self.ram_budget < 0:
            raise ValueError("budgets cannot be negative")

    @property
    def slot_bytes(self) -> int:
        """One VRAM slot holds any expert: the largest blob."""
        return max(self.blob_bytes, default=0)


@dataclass(frozen=True)
class Stage:
    """One device's share of a placement: the layers it runs and its VRAM slots."""

    layers: range
    slots: int

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"{self.slots} VRAM slots for layers {self.layers}")


@dataclass(frozen=True)
class ResidencyPlan:
    n_layers: int
    n_experts: int
    slot_bytes: int
    vram: tuple[ExpertUnit, ...]  # the cache's initial fill, hottest first
    ram: tuple[ExpertUnit, ...]  # resident copies, in pinning order (hottest first)
    vram_budget: int
    ram_budget: int
    ram_bytes: int  # what the resident copies take (<= ram_budget)
    stages: tuple[Stage, ...] = ()  # the per-device split (one stage: every layer)
    hash: str = field(default="", compare=False)

    @property
    def vram_bytes(self) -> int:
        return len(self.vram) * self.slot_bytes

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_experts

    @cached_property
    def vram_set(self) -> frozenset[ExpertUnit]:
        return frozenset(self.vram)

    @cached_property
    def ram_set(self) -> frozenset[ExpertUnit]:
        return frozenset(self.ram)

    @cached_property
    def covered(self) -> frozenset[ExpertUnit]:
        """Experts with a copy outside the file: in RAM, or held in VRAM for good."""
        return self.ram_set | self.vram_set

    @cached_property
    def vram_only(self) -> frozenset[ExpertUnit]:
        """VRAM experts without a RAM copy: the cache keeps them (they are not evicted)."""
        return self.vram_set - self.ram_set

    def tier(self, unit: ExpertUnit) -> Tier:
        """The fastest tier the plan starts `unit` in."""
        if unit in self.vram_set:
            return "vram"
        return "ram" if unit in self.ram_set else "file"

    @property
    def bounds(self) -> tuple[int, ...]:
        """The layer split as boundaries: (0, n_layers) on one device."""
        return (0, *(s.layers.stop for s in self.stages))

    def residents(self) -> list[list[int]]:
        """Each layer's experts that start in VRAM, by expert index (the engine's slots)."""
        return _by_layer(self.vram, self.n_layers)

    def in_ram(self) -> list[list[int]]:
        """Each layer's experts with a RAM copy, by expert index (the engine's RAM tier)."""
        return _by_layer(self.ram, self.n_layers)

    @cached_property
    def file_only(self) -> tuple[ExpertUnit, ...]:
        covered = self.covered
        return tuple(
            ExpertUnit(layer, e)
            for layer in range(self.n_layers)
            for e in range(self.n_experts)
            if ExpertUnit(layer, e) not in covered
        )


def _by_layer(units: Sequence[ExpertUnit], n_layers: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n_layers)]
    for unit in units:
        out[unit.layer].append(unit.expert)
    return [sorted(r) for r in out]


def rank(inputs: PlanInputs) -> list[int]:
    """Flat indices, hottest first; ties by expert, then layer."""
    e = inputs.n_experts
    return sorted(range(len(inputs.counts)), key=lambda i: (-inputs.counts[i], i % e, i // e))


def _prefix(order: Sequence[int], sizes: Sequence[int], budget: int) -> list[int]:
    taken, used = [], 0
    for i in order:
        if used + sizes[i] > budget:
            break
        taken.append(i)
        used += sizes[i]
    return taken


def plan_hash(plan: ResidencyPlan) -> str:
    """12 hex digits over what the plan places (not over how it was asked for); a layer
    split is part of it (one device hashes as it always did)."""
    h = hashlib.sha256(b"strata-plan-v1")
    h.update(f"{plan.n_layers},{plan.n_experts},{plan.slot_bytes};".encode())
    if len(plan.stages) > 1:
        h.update(("split:" + ",".join(map(str, plan.bounds)) + ";").encode())
    for name, units in (("vram", plan.vram), ("ram", plan.ram)):
        h.update(name.encode() + b":" + ",".join(f"{u.layer}.{u.expert}" for u in units).encode())
    return h.hexdigest()[:12]


def slot_count(
    expert_cache: int | str, free_bytes: int | None, reserve_bytes: int, slot_bytes: int
) -> int:
    """VRAM slots of one device: `store.expert_cache` when it is a number; auto: what the
    free VRAM reading holds after `reserve_bytes` (none without a reading)."""
    if expert_cache != "auto":
        return int(expert_cache)
    if free_bytes is None or slot_bytes <= 0:
        return 0
    return max(free_bytes - reserve_bytes, 0) // slot_bytes


def one_stage(inputs: PlanInputs) -> Stage:
    """All layers on one device, with the slots `inputs.vram_budget` holds."""
    slot = inputs.slot_bytes
    n = len(inputs.counts)
    return Stage(range(inputs.n_layers), min(inputs.vram_budget // slot, n) if slot else 0)


def place(inputs: PlanInputs, stages: Sequence[Stage] | None = None) -> ResidencyPlan:
    """Tiers for every expert and the per-device split: the one placement function.

    `stages` must cover the layers in order; each takes the hottest experts of its own
    layers into its slots (None: one device, `one_stage(inputs)`)."""
    e, sizes = inputs.n_experts, inputs.blob_bytes
    split = tuple(stages) if stages is not None else (one_stage(inputs),)
    if (
        not split
        or split[0].layers.start != 0
        or split[-1].layers.stop != inputs.n_layers
        or any(a.layers.stop != b.layers.start for a, b in zip(split, split[1:], strict=False))
    ):
        covered = [s.layers for s in split]
        raise ValueError(f"stages {covered} do not cover {inputs.n_layers} layers")
    order = rank(inputs)
    vram: list[int] = []
    for stage in split:
        lo, hi = stage.layers.start * e, stage.layers.stop * e
        vram += [i for i in order if lo <= i < hi][: stage.slots]
    taken = set(vram)
    position = {i: n for n, i in enumerate(order)}
    vram.sort(key=position.__getitem__)  # hottest first across the devices
    # the VRAM experts' copies are there to be evicted to; with every expert in VRAM nothing
    # misses, so none is ever evicted and RAM holds nothing (no pinning, no locked RAM)
    backups = vram if len(vram) < len(order) else []
    ram = _prefix([i for i in order if i not in taken] + backups, sizes, inputs.ram_budget)

    def units(idx: list[int]) -> tuple[ExpertUnit, ...]:
        return tuple(ExpertUnit(i // e, i % e) for i in idx)

    plan = ResidencyPlan(
        n_layers=inputs.n_layers,
        n_experts=e,
        slot_bytes=inputs.slot_bytes,
        vram=units(vram),
        ram=units(ram),
        vram_budget=inputs.vram_budget,
        ram_budget=inputs.ram_budget,
        ram_bytes=sum(sizes[i] for i in ram),
        stages=split,
    )
    return replace(plan, hash=plan_hash(plan))


# --- the RAM budget -----------------------------------------------------------------------


@dataclass(frozen=True)
class RamBudget:
    """The resident budget and the terms it was computed from, for the log."""

    bytes: int
    terms: tuple[tuple[str, int], ...]  # (name, bytes): MemTotal first, then what is subtracted
    configured: bool  # store.resident_budget_gib was a number

    def describe(self) -> str:
        if self.configured:
            return f"resident budget {self.bytes / GiB:.2f} GiB (store.resident_budget_gib)"
        (name, total), *minus = self.terms
        parts = " - ".join(f"{n} {b / GiB:.2f}" for n, b in minus)
        return (
            f"resident budget {self.bytes / GiB:.2f} GiB = {name} {total / GiB:.2f} - {parts} GiB"
        )


def ram_budget(
    configured_gib: float | None,
    mem_total: int,
    reserves: Sequence[tuple[str, int]],
    mem_total_name: str = "MemTotal",
) -> RamBudget:
    """`configured_gib` if set, else `mem_total` minus each named reserve (never below zero).

    `reserves` are what the daemon and the host hold besides the resident set: the headroom
    left to the rest of the host, the dense weights, the runtime, the host KV cache.
    """
    if configured_gib is not None:
        return RamBudget(int(configured_gib * GiB), (), True)
    left = mem_total - sum(b for _, b in reserves)
    return RamBudget(max(left, 0), ((mem_total_name, mem_total), *reserves), False)
