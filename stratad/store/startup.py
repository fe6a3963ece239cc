"""Starting the store: budget -> plan -> admission -> coverage line -> fill and pin.

Everything the start depends on is an argument (the machine's readings default to the real
ones), so that the log lines an operator greps for are asserted in tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from stratad.config import Config, StoreConfig
from stratad.model.spec import Model
from stratad.store.placement.admission import (
    AdmissionPolicy,
    MemReader,
    admit,
    mem_available,
    mem_total,
)
from stratad.store.placement.bandwidth import Bandwidths, measure_bandwidths
from stratad.store.placement.coverage import coverage, log_coverage, prompt_cost
from stratad.store.placement.plan import (
    PlanInputs,
    RamBudget,
    ResidencyPlan,
    Stage,
    place,
    ram_budget,
    slot_count,
)
from stratad.store.placement.profile import ExpertProfile, load_profile, uniform_profile
from stratad.store.sizes import GiB, MiB
from stratad.store.store import ExpertStore
from stratad.store.tiers.lock import choose_locker
from stratad.store.tiers.original import repair_source
from stratad.store.tiers.pinning import PinSettings, ProgressFn
from stratad.store.tiers.ram_form import AsInFile, RamForm
from stratad.store.tiers.sources import ExpertSource, ModelExperts, PackExperts

log = logging.getLogger("stratad.store")

BACKOFF_MAX_S = 10.0


def open_source(config: StoreConfig, model: Model) -> ExpertSource:
    """The pack's experts if `store.pack` is set, else the model file's, read in place."""
    if config.pack:
        return PackExperts(Path(config.pack))
    return ModelExperts(model)


def daemon_reserves(
    config: Config, dense_host_bytes: int, kv_host_bytes: int = 0,
    kv_label: str = "KV caches (server.parallel)",
) -> list[tuple[str, int]]:
    """What the daemon holds in host RAM besides the resident set and the named store
    reserves: dense weights kept on the host (0 when they live on the GPU), the working KV
    caches where they are on the host (one of the whole context per `server.parallel`, or
    the blocks beyond a resident window), and the server's host caches."""
    kv = [(kv_label, kv_host_bytes)] if kv_host_bytes else []
    return [
        ("dense weights", dense_host_bytes),
        *kv,
        ("server.conversation_cache_mib", config.server.conversation_cache_mib * MiB),
        ("server.pinned_prefix_mib", config.server.pinned_prefix_mib * MiB),
    ]


def vram_slots(config: StoreConfig, device: torch.device, slot_bytes: int) -> int:
    """The store's VRAM slots on `device` (its free VRAM read now, in auto mode)."""
    free = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
    return slot_count(config.expert_cache, free, int(config.vram_reserve_gib * GiB), slot_bytes)


def slot_bytes(source: ExpertSource) -> int:
    """One VRAM slot of the store holds any of the source's blobs."""
    return max(lay.stride for lay in source.layouts)


def plan_inputs(
    source: ExpertSource,
    profile: ExpertProfile,
    slots: int,
    ram_budget_bytes: int,
    ram_form: RamForm | None = None,
) -> PlanInputs:
    """What the plan is made from; each blob sized as `ram_form` keeps it in RAM (default: as
    in the file)."""
    form = ram_form or AsInFile(source.layouts)
    sizes = tuple(
        form.stride(layer) for layer in range(source.n_layers) for _ in range(source.n_experts)
    )
    return PlanInputs(
        n_layers=source.n_layers,
        n_experts=source.n_experts,
        blob_bytes=sizes,
        counts=profile.flat,
        vram_budget=slots * max(sizes, default=0),
        ram_budget=ram_budget_bytes,
    )


def describe_plan(plan: ResidencyPlan) -> str:
    return (
        f"residency plan {plan.hash}: {len(plan.vram)} experts start in VRAM"
        f" ({plan.vram_bytes / GiB:.2f} GiB), {len(plan.ram)} keep a copy in RAM"
        f" ({plan.ram_bytes / GiB:.2f} of {plan.ram_budget / GiB:.2f} GiB),"
        f" {len(plan.file_only)} of {plan.n_total} are read from the file only"
    )


@dataclass(frozen=True)
class Planned:
    """The plan as the configuration asks for it, before admission."""

    inputs: PlanInputs
    budget: RamBudget
    plan: ResidencyPlan


def plan_store(
    config: StoreConfig,
    source: ExpertSource,
    *,
    stages: Sequence[Stage],
    profile: ExpertProfile | None = None,
    reserves: Sequence[tuple[str, int]] = (),
    host_total: tuple[int, str] | None = None,
    ram_form: RamForm | None = None,
) -> Planned:
    """Budget and plan for the devices' `stages` (layers and VRAM slots of each): what a
    start runs from, and what a dry run (`stratactl check`) shows. Reads MemTotal (never
    MemAvailable) unless `host_total`."""
    if profile is None and config.expert_profile:
        profile = load_profile(Path(config.expert_profile), source.n_layers, source.n_experts)
    profile = profile or uniform_profile(source.n_layers, source.n_experts)
    total, total_name = host_total or mem_total()
    configured = None if config.resident_budget_gib == "auto" else float(config.resident_budget_gib)
    budget = ram_budget(
        configured,
        total,
        [
            ("resident_headroom_gib", int(config.resident_headroom_gib * GiB)),
            ("reserve_runtime_gib", int(config.reserve_runtime_gib * GiB)),
            *reserves,
        ],
        total_name,
    )
    inputs = plan_inputs(source, profile, sum(s.slots for s in stages), budget.bytes, ram_form)
    return Planned(inputs, budget, place(inputs, stages))


@dataclass(frozen=True)
class Admitted:
    """The plan a start runs with, after admission, and what it was made from."""

    planned: Planned  # the plan the configuration asked for
    plan: ResidencyPlan  # the plan admitted (smaller when degraded)
    degraded: bool
    bandwidths: Bandwidths


def plan_and_admit(
    config: StoreConfig,
    source: ExpertSource,
    *,
    stages: Sequence[Stage],
    compute_device: torch.device,
    profile: ExpertProfile | None = None,
    reserves: Sequence[tuple[str, int]] = (),
    host_total: tuple[int, str] | None = None,
    read_available: MemReader = mem_available,
    bandwidths: Bandwidths | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    ram_form: RamForm | None = None,
) -> Admitted:
    """Budget -> plan -> measured bandwidths -> admission -> the coverage line: the start of
    every engine that serves experts (the store's, and the offload engine's)."""
    planned = plan_store(config, source, stages=stages, profile=profile, reserves=reserves,
                         host_total=host_total, ram_form=ram_form)  # fmt: skip
    inputs, plan = planned.inputs, planned.plan
    log.info(planned.budget.describe())
    log.info(describe_plan(plan))

    bw = bandwidths or measure_bandwidths(source, compute_device)
    log.info("measured bandwidths: %s", bw.describe())

    def cost(p: ResidencyPlan) -> str:
        cov = coverage(p, inputs.blob_bytes, inputs.counts)
        return (
            f"{cov.covered} of {cov.total} experts keep a copy in RAM or VRAM, expect up to"
            f" {100 * prompt_cost(cov, bw):.0f}% less prompt speed on long prompts"
        )

    policy = AdmissionPolicy(
        mode=config.on_short_ram,
        wait_s=config.admission_wait_s,
        backoff_s=config.admission_backoff_s,
        backoff_max_s=max(BACKOFF_MAX_S, config.admission_backoff_s),
        headroom_bytes=int(config.resident_headroom_gib * GiB),
    )
    admitted = admit(
        plan,
        lambda b: place(replace(inputs, ram_budget=b), stages),
        policy,
        read_available,
        cost=cost,
        sleep=sleep,
        clock=clock,
    )
    plan = admitted.plan
    log_coverage(coverage(plan, inputs.blob_bytes, inputs.counts), bw, plan, source.label)
    return Admitted(planned, plan, admitted.degraded, bw)


def open_store(
    config: StoreConfig,
    source: ExpertSource,
    *,
    compute_device: torch.device,
    cache_device: torch.device | None = None,
    profile: ExpertProfile | None = None,
    reserves: Sequence[tuple[str, int]] = (),
    host_total: tuple[int, str] | None = None,
    read_available: MemReader = mem_available,
    bandwidths: Bandwidths | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    on_pin_progress: ProgressFn | None = None,
    stages: Sequence[Stage] | None = None,
    ram_form: RamForm | None = None,
) -> ExpertStore:
    """Plan, admit and start the store (on `stages`, or one stage with the slots the
    cache device holds now). Raises `AdmissionRefused` (exit code 75) in strict
    mode when the RAM is not there. `reserves` are subtracted by the auto budget besides the
    headroom and the runtime reserve (see `daemon_reserves`). A pack's damaged blobs are read
    from its original; without one, every blob is checked first (`DamagedPack`, exit 65).
    `ram_form`: the form the RAM copies are made in (and the plan sizes them in; default: as in
    the file)."""
    cache_device = cache_device or compute_device
    repair = repair_source(source) if isinstance(source, PackExperts) else None
    if stages is None:
        slots = vram_slots(config, cache_device, slot_bytes(source))
        stages = (Stage(range(source.n_layers), slots),)
    started = plan_and_admit(
        config,
        source,
        stages=stages,
        compute_device=compute_device,
        profile=profile,
        reserves=reserves,
        host_total=host_total,
        read_available=read_available,
        bandwidths=bandwidths,
        sleep=sleep,
        clock=clock,
        ram_form=ram_form,
    )
    plan = started.plan
    store = ExpertStore(
        source,
        plan,
        cache_device=cache_device,
        lock=choose_locker(config.lock, compute_device, plan.ram_bytes),
        pin=PinSettings(config.pin_chunk_mib * MiB, config.pin_rate_gbps * 1e9),
        policy=config.cache_policy,
        admit_on_miss=config.admit_on_miss,
        on_pin_progress=on_pin_progress,
        counts=started.planned.inputs.counts,
        bandwidths=started.bandwidths,
        budget=started.planned.budget,
        degraded=started.degraded,
        repair=repair,
        ram_form=ram_form,
    )
    store.start()
    if config.ready_after_pinning:
        store.pinner.wait()
    return store
