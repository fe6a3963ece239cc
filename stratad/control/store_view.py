"""Adapter: the expert store (`stratad.store`) as the control socket and `stratactl check` see it.

This is the one place that turns the store's objects into protocol replies. The store's
modules import torch, so they are imported inside the functions: `stratad.control` itself
stays torch-free, and only the daemon (which has torch loaded) or `stratactl check` (which
imports it on purpose, for a dry plan of a MoE model) call in here.

Adapter points (what the daemon's engine must hand over; see `Operations.loaded`):
- the engine exposes the running store as `engine.store` (an `ExpertStore`); the view reads
  its plan, hit counters, read counters and pinning progress;
- optional attributes on the store, used when present: `counts` (the profile's layer-major
  routing counts the plan was made from), `bandwidths` (`Bandwidths` measured at start, for the
  cost estimate), `degraded` (admission ran a smaller plan), `budget` (`RamBudget`);
- the engine's routing counts (`engine.forward.route_counts`, [layers, experts]) are what
  `profile-save` writes; the store's `store.expert_profile` path is the default target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from stratad.control.provider import Unavailable
from stratad.protocol import (
    CoverageReply,
    LayerCoverage,
    PlanReply,
    ProfileSaveReply,
    Tier,
)

GiB = 1 << 30


def blob_sizes(layouts: Sequence[Any], n_experts: int) -> tuple[int, ...]:
    """Layer-major blob sizes as the plan counts them (each blob's aligned stride)."""
    return tuple(lay.stride for lay in layouts for _ in range(n_experts))


def plan_reply(
    plan: Any,
    sizes: Sequence[int],
    *,
    degraded: bool = False,
    budget: Any = None,
    headroom_bytes: int = 0,
    mem_total: int = 0,
    inputs: dict[str, str] | None = None,
) -> PlanReply:
    """A `ResidencyPlan` as the `plan` verb's reply."""
    e = plan.n_experts
    file_only = plan.file_only
    terms = dict(budget.terms) if budget is not None and budget.terms else {}
    return PlanReply(
        hash=plan.hash,
        moe=True,
        vram=Tier(experts=len(plan.vram), bytes=plan.vram_bytes),
        ram=Tier(experts=len(plan.ram), bytes=plan.ram_bytes),
        file=Tier(
            experts=len(file_only), bytes=sum(sizes[u.layer * e + u.expert] for u in file_only)
        ),
        vram_budget_bytes=plan.vram_budget,
        ram_budget_bytes=plan.ram_budget,
        headroom_bytes=headroom_bytes,
        mem_total_bytes=mem_total or next(iter(terms.values()), 0),
        degraded=degraded,
        inputs=inputs or {},
    )


def coverage_reply(
    plan: Any,
    sizes: Sequence[int],
    counts: Sequence[int],
    bandwidths: Any = None,
    file_reads: int = 0,
    file_read_bytes: int = 0,
    file: str = "",
) -> CoverageReply:
    """Coverage of a `ResidencyPlan`, per layer and overall, with the cost estimate."""
    from stratad.store.placement.coverage import coverage, prompt_cost

    cov = coverage(plan, sizes, counts)
    e = plan.n_experts
    vram_per_layer = [0] * plan.n_layers
    ram_per_layer = [0] * plan.n_layers
    for u in plan.vram:
        vram_per_layer[u.layer] += 1
    for u in plan.ram:
        ram_per_layer[u.layer] += 1
    layers = []
    for layer, (covered, total) in enumerate(cov.per_layer):
        row = counts[layer * e : (layer + 1) * e]
        mass = sum(row)
        kept = sum(row[u.expert] for u in plan.covered if u.layer == layer)
        layers.append(
            LayerCoverage(
                layer=layer,
                experts=total,
                in_vram=vram_per_layer[layer],
                in_ram=ram_per_layer[layer],
                file_only=total - covered,
                routed_mass=kept / mass if mass else covered / max(total, 1),
            )
        )
    slowdown = prompt_cost(cov, bandwidths) if bandwidths is not None else None
    cost = ""
    if not cov.complete:
        cost = (
            f"{cov.file_units} experts ({cov.file_bytes / GiB:.2f} GiB) are read from the"
            " file when routed"
        )
        if slowdown is not None:
            cost += (
                f"; expect up to {100 * slowdown:.0f}% less prompt speed on long prompts"
                f" (measured {bandwidths.describe()})"
            )
    return CoverageReply(
        moe=True,
        experts=cov.total,
        in_vram=len(plan.vram),
        in_ram=len(plan.ram),
        in_file_only=cov.file_units,
        routed_mass=(
            cov.mass_share if cov.mass_share is not None else cov.covered / max(cov.total, 1)
        ),
        complete=cov.complete,
        file_reads=file_reads,
        file_read_bytes=file_read_bytes,
        estimated_cost=cost,
        estimated_slowdown=slowdown,
        layers=layers,
        file=file,
    )


class ExpertStoreView:
    """`stratad.control.state.StoreView` over a running `ExpertStore` (duck-typed)."""

    def __init__(
        self,
        store: Any,
        route_counts: Callable[[], list[list[int]]] | None = None,
        profile_path: str = "",
        headroom_bytes: int = 0,
    ) -> None:
        self.store = store
        self.route_counts = route_counts
        self.profile_path = profile_path
        self.headroom_bytes = headroom_bytes
        plan = store.plan
        self.sizes = blob_sizes(store.layouts, plan.n_experts)
        self.counts: Sequence[int] = getattr(store, "counts", None) or (0,) * plan.n_total

    def plan(self) -> PlanReply:
        return plan_reply(
            self.store.plan,
            self.sizes,
            degraded=bool(getattr(self.store, "degraded", False)),
            budget=getattr(self.store, "budget", None),
            headroom_bytes=self.headroom_bytes,
        )

    def coverage(self) -> CoverageReply:
        """Coverage as the store holds it: a resident copy the pinner skipped (its blob failed
        its checksum) covers nothing."""
        stats = self.store.stats()
        plan, damaged = self.store.plan, self.damaged_units()
        source = getattr(self.store, "source", None)
        if damaged:
            plan = dataclasses.replace(plan, ram=tuple(u for u in plan.ram if u not in damaged))
        reply = coverage_reply(
            plan,
            self.sizes,
            self.counts,
            getattr(self.store, "bandwidths", None),
            stats.file_reads,
            stats.file_bytes,
            f"the {source.kind} {source.label}" if source is not None else "",
        )
        if damaged:
            reply = msgspec.structs.replace(
                reply, estimated_cost=f"{self.damaged()}; {reply.estimated_cost}"
            )
        return reply

    def damaged_units(self) -> frozenset[Any]:
        """The experts whose resident copy was skipped: their blob failed its checksum."""
        pinner = getattr(self.store, "pinner", None)
        return frozenset(unit for unit, _ in getattr(pinner, "failed", ()))

    def damaged(self) -> str | None:
        """In words, for /health's `degraded` and the coverage WARNING; None when none is."""
        units = sorted(self.damaged_units(), key=lambda u: (u.layer, u.expert))
        if not units:
            return None
        named = ", ".join(f"layer {u.layer} expert {u.expert}" for u in units[:4])
        more = f" and {len(units) - 4} more" if len(units) > 4 else ""
        return (
            f"{len(units)} expert blob(s) failed their checksum ({named}{more}): not resident,"
            " read from the file when routed"
        )

    def tier_hits(self) -> dict[str, int]:
        s = self.store.stats()
        return {"vram": s.vram_hits, "ram": s.ram_hits, "file": s.file_hits}

    def pinned_bytes(self) -> int:
        return int(self.store.stats().pinned_bytes)

    def slot_moves(self) -> int:
        """Experts copied into VRAM slots so far (the cache policy's evictions)."""
        return int(self.store.stats().evictions)

    def save_profile(self, path: str) -> ProfileSaveReply:
        from stratad.store.placement.profile import profile_from_counts, save_profile

        target = profile_target(path, self.profile_path)
        if self.route_counts is None:
            raise Unavailable("this engine does not record routing counts")
        profile = profile_from_counts(self.route_counts())
        save_profile(profile, target)
        return ProfileSaveReply(
            path=str(target),
            experts=profile.n_layers * profile.n_experts,
            bytes=Path(target).stat().st_size,
        )


def profile_target(path: str, configured: str) -> Path:
    """Where `profile-save` writes: `store.expert_profile`, or a file the peer names in that
    file's directory (a relative name is taken there). The daemon writes with its own rights,
    so a peer never picks a directory."""
    if not configured:
        raise Unavailable("store.expert_profile is not set: profile-save writes only beside it")
    if "\0" in path:
        raise Unavailable("the profile name holds a NUL byte")
    home = Path(configured).parent
    target = Path(path) if path else Path(configured)
    if not target.is_absolute():
        target = home / target
    if target.parent.resolve() != home.resolve() or target.name in ("", ".", ".."):
        raise Unavailable(
            f"{path}: profile-save writes only in {home} (the directory of store.expert_profile)"
        )
    return target


def store_view_of(engine: Any, config: Any) -> ExpertStoreView | None:
    """The view of `engine.store`, if the engine runs one (else None: reference engine)."""
    store = getattr(engine, "store", None)
    if store is None:
        return None
    forward: Any = getattr(engine, "forward", None)
    counted = hasattr(forward, "route_counts")  # read when asked (a split sums its stages then)
    return ExpertStoreView(
        store,
        route_counts=(lambda: forward.route_counts.tolist()) if counted else None,
        profile_path=config.store.expert_profile,
        headroom_bytes=int(config.store.resident_headroom_gib * GiB),
    )


class DryPlan:
    """The plan a start would make, computed without loading anything (`stratactl check`)."""

    def __init__(self, plan: PlanReply, coverage: CoverageReply) -> None:
        self.plan = plan
        self.coverage = coverage


def dry_plan(
    config: Any,
    model_path: Path,
    free_vram: Sequence[int | None],
    host_total: tuple[int, str] | None = None,
) -> DryPlan:
    """The residency plan of `config` for this host, as the daemon computes it at start.

    The same calls as the daemon's start (`stratad.engine.placement.start_plan`, then the
    store's `plan_store`), up to admission: the engine that would run, its layer split and
    VRAM slots from `free_vram` (each GPU's free bytes, None: no GPU seen), the budget terms
    and the profile. The model is mapped, not read.
    """
    import torch

    from stratad.engine import placement
    from stratad.engine.runner import configured_model
    from stratad.store.loader import load_model
    from stratad.store.placement.admission import mem_total
    from stratad.store.startup import open_source, plan_store, slot_bytes

    host_total = host_total or mem_total()
    model = configured_model(load_model(model_path), config)
    on_gpu = config.engine.device != "cpu" and any(f is not None for f in free_vram)
    device = torch.device("cuda" if on_gpu else "cpu")
    store = placement.store_config(config, model_path)
    source = open_source(store, model)
    try:
        start = placement.start_plan(
            config, model, device, free_vram, slot_bytes(source), host_total[0]
        )
        form = None
        if start.backend == "cpu":  # the cpu engine's RAM copies may take its kernels' layout
            from stratad.engine.reference.interleaved_ram import ram_form
            from stratad.engine.reference.weights_mode import cpu_weights

            form = ram_form(cpu_weights(config.engine), model, source, start.stages)
        planned = plan_store(store, source, stages=start.stages, reserves=start.reserves,
                             host_total=host_total, ram_form=form)  # fmt: skip
    finally:
        source.close()
    plan, inputs, budget = planned.plan, planned.inputs, planned.budget
    slots = "+".join(str(s.slots) for s in start.stages)
    return DryPlan(
        plan_reply(
            plan,
            inputs.blob_bytes,
            budget=budget,
            headroom_bytes=int(store.resident_headroom_gib * GiB),
            mem_total=host_total[0],
            inputs={
                "source": str(store.pack or model_path),
                "profile": store.expert_profile or "(none: uniform)",
                "engine": start.backend,
                "vram_slots": slots,
                "layer_split": ",".join(map(str, plan.bounds)),
                "parallel": start.parallel.describe(),
                "ram_budget": budget.describe(),
            },
        ),
        coverage_reply(plan, inputs.blob_bytes, inputs.counts),
    )
