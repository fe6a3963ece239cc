"""Which forward pass serves a model, and how the offload engine is started.

`reference`: the torch reference forward; a MoE model's experts come through the expert store
(`stratad.store`), on any device. `offload`: the GPU engine for MoE models larger than VRAM
(`stratad.engine.offload`): every expert in page-locked RAM, the hottest in VRAM slots, misses
fetched over PCIe (`engine.gpu_miss`). Both start from the same deterministic residency plan, so
the plan hash, the coverage line and the control socket's views mean the same thing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from kernels.moe import split_q4_0_ok
from kernels.quant import QType
from stratad.config import Config
from stratad.engine.experts import blob_layout
from stratad.engine.kernel_table import kernel_configs
from stratad.engine.offload import OffloadConfig, OffloadForward
from stratad.engine.stages import StagedForward, balanced_split, parse_split
from stratad.engine.timing import StageTimer
from stratad.model.spec import Model, ModelError
from stratad.store.admission import AdmissionRefused
from stratad.store.bandwidth import Bandwidths
from stratad.store.pinning import PinProgress, ProgressFn
from stratad.store.plan import ResidencyPlan
from stratad.store.sizes import GiB, MiB
from stratad.store.startup import (
    daemon_reserves,
    open_source,
    plan_and_admit,
    vram_slots,
)
from stratad.store.store import StoreStats

log = logging.getLogger("stratad.engine")


def choose_backend(name: str, model: Model, device: torch.device) -> str:
    """`auto` is the offload engine for a MoE model with Q4_0 experts on a GPU."""
    if name != "auto":
        if name == "offload" and not model.spec.is_moe:
            raise ModelError(f"{model.source}: engine.backend=offload serves MoE models only")
        if name == "offload" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ModelError(
                "engine.backend=offload on the CPU runs its kernels in Triton's interpreter"
                " (for tests): set TRITON_INTERPRET=1, or use a GPU"
            )
        return name
    if device.type == "cuda" and offload_supported(model):
        return "offload"
    return "reference"


def offload_supported(model: Model) -> bool:
    """A MoE model whose experts are Q4_0 with rows the fused kernel reads as aligned words."""
    spec = model.spec
    if not spec.is_moe or blob_layout(model).qtype != QType.Q4_0:
        return False
    shapes = ((spec.expert_ffn, spec.hidden), (spec.hidden, spec.expert_ffn))
    return all(split_q4_0_ok(rows, cols) for rows, cols in shapes)


class OffloadTiers:
    """The offload engine's tiers as the control socket sees a store (`plan`, `stats()`)."""

    def __init__(
        self,
        plan: ResidencyPlan,
        forward: OffloadForward | StagedForward,
        source: Any,
        counts: tuple[int, ...],
        bandwidths: Bandwidths,
        budget: Any,
    ) -> None:
        self.plan, self.forward, self.source = plan, forward, source
        self.layouts = source.layouts
        self.counts, self.bandwidths, self.budget = counts, bandwidths, budget
        self.degraded = False

    def stats(self) -> StoreStats:
        f = self.forward
        return StoreStats(
            plan_hash=self.plan.hash, vram_hits=f.hits, ram_hits=f.lookups - f.hits,
            file_hits=0, evictions=f.moves, file_reads=0, file_bytes=0,
            pinned_bytes=f.host.pinned_bytes, planned_ram_bytes=f.host.nbytes,
            vram_slots=f.n_slots,
        )  # fmt: skip


def open_offload(
    config: Config,
    model: Model,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int,
    timer: StageTimer,
    on_pin_progress: ProgressFn | None = None,
) -> tuple[OffloadForward | StagedForward, OffloadTiers]:
    """Plan (the store's pure planner), admit (wait for the RAM), fill and pin, then build."""
    store = config.store
    source = open_source(store, model)
    devices, bounds = _devices(config, model, device)
    n = model.spec.n_layers
    slots = [
        _slots(config, model, d, dtype, max_context, (hi - lo) / n)
        for d, lo, hi in zip(devices, bounds[:-1], bounds[1:], strict=True)
    ]
    started = plan_and_admit(store, source, slots=sum(slots), compute_device=devices[0],
                             reserves=daemon_reserves(config, 0))  # fmt: skip
    plan, inputs, bw = started.plan, started.planned.inputs, started.bandwidths
    if len(plan.ram) < plan.n_total:
        raise AdmissionRefused(
            f"the offload engine keeps every expert in page-locked RAM and fetches misses from it,"
            f" but the plan {plan.hash} has room for {len(plan.ram)} of {plan.n_total}"
            f" ({plan.ram_bytes / GiB:.2f} of {sum(inputs.blob_bytes) / GiB:.2f} GiB): raise"
            " store.resident_budget_gib or lower store.resident_headroom_gib, or set"
            ' engine.backend = "reference" to read experts from the file'
        )
    layout = blob_layout(model)
    cfg = OffloadConfig(
        expert_vram_bytes=len(plan.vram) * layout.nbytes, max_context=max_context,
        dtype=dtype, graphs=device.type == "cuda" and not timer.enabled,
        prefill_chunk=config.engine.offload_prefill_chunk,
        cache_policy=config.store.cache_policy, gpu_miss=config.engine.gpu_miss,
        kernels=kernel_configs(device.type), prefetch=config.engine.prefetch,
    )  # fmt: skip
    t0 = time.monotonic()
    forward: OffloadForward | StagedForward
    if len(devices) == 1:
        residents: list[list[int]] = [[] for _ in range(plan.n_layers)]
        for unit in plan.vram:
            residents[unit.layer].append(unit.expert)
        forward = OffloadForward(model, device, cfg, residents=[sorted(r) for r in residents],
                                 pin=_pin_settings(config, on_pin_progress))  # fmt: skip
    else:
        residents = stage_residents(inputs.counts, model.spec.n_experts, bounds, slots)
        forward = StagedForward(model, devices, bounds, cfg, residents=residents)
    forward.timer = timer
    forward.set_pcie_frac(_pcie_frac(config.engine.pcie_frac, forward, bw))
    log.info(
        "decode misses: the GPU takes %.0f%% (%s), the CPU the rest",
        100 * forward.config.pcie_frac,
        "fetched into VRAM" if cfg.gpu_miss == "copy" else "read in place",
    )
    log.info("offload engine ready in %.1f s", time.monotonic() - t0)
    return forward, OffloadTiers(plan, forward, source, inputs.counts, bw, started.planned.budget)


def _devices(
    config: Config, model: Model, device: torch.device
) -> tuple[list[torch.device], list[int]]:
    """The devices of the engine and the layer bounds of each (one device: all layers)."""
    gpus = config.engine.gpus
    n = model.spec.n_layers
    if len(gpus) < 2:
        return [device], [0, n]
    devices = [torch.device("cuda", g) for g in gpus]
    if config.engine.layer_split != "auto":
        return devices, parse_split(config.engine.layer_split, n, len(devices))
    free = [float(torch.cuda.mem_get_info(d)[0]) for d in devices]
    return devices, balanced_split(n, free)


def stage_residents(
    counts: Sequence[int], n_experts: int, bounds: Sequence[int], slots: Sequence[int]
) -> list[list[int]]:
    """Each stage's VRAM slots go to the hottest experts of its own layers (by the profile's
    counts, ties by layer then expert): a pure function, so a split starts the same way."""
    residents: list[list[int]] = [[] for _ in range(bounds[-1])]
    for lo, hi, n in zip(bounds[:-1], bounds[1:], slots, strict=True):
        units = [(layer, e) for layer in range(lo, hi) for e in range(n_experts)]
        units.sort(key=lambda u: (-counts[u[0] * n_experts + u[1]], u[0], u[1]))
        for layer, e in units[:n]:
            residents[layer].append(e)
    return [sorted(r) for r in residents]


def _pcie_frac(
    setting: float | str, forward: OffloadForward | StagedForward, bw: Bandwidths
) -> float:
    """The miss policy: the configured share, or one that lets PCIe and the CPU finish
    together (and 1 when the CPU's share is too small to pay for a sync per layer)."""
    if setting != "auto":
        return float(setting)
    cpu = forward.measure_cpu_expert_bps()
    share = cpu / (cpu + bw.copy_bps)
    frac = 1.0 if share < 0.1 else round(1.0 - share, 2)
    log.info(
        "miss policy: pcie_frac %.2f (resident copy %.2f GB/s, CPU experts %.2f GB/s)",
        frac, bw.copy_bps / 1e9, cpu / 1e9,
    )  # fmt: skip
    return frac


def _slots(
    config: Config,
    model: Model,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int,
    layer_share: float = 1.0,
) -> int:
    """VRAM slots for experts: the configured count, or (auto) what the free VRAM holds after
    everything else the engine will allocate there: dense weights, the KV cache, the two
    prefill staging buffers and `store.vram_reserve_gib` for activations and the runtime."""
    store = config.store
    layout = blob_layout(model)
    if store.expert_cache != "auto" or device.type != "cuda":
        return vram_slots(store, device, layout.nbytes)
    spec, size = model.spec, torch.finfo(dtype).bits // 8
    dense = layer_share * model.dense_values()
    kv = 2 * spec.n_layers * layer_share * max_context * spec.kv_dim * size
    # prefill: two layers of blobs in flight and one dequantized for the grouped GEMMs;
    # decode: top-k blobs of fetch staging, and two layers' guesses when prefetching
    fetched = (3 if config.engine.prefetch else 1) * spec.n_experts_used * layout.nbytes
    dequantized = 3 * spec.n_experts * spec.hidden * spec.expert_ffn * size
    staging = 2 * spec.n_experts * layout.nbytes + dequantized + fetched
    free, _ = torch.cuda.mem_get_info(device)
    left = free - dense * size - kv - staging - int(store.vram_reserve_gib * GiB)
    log.info(
        "VRAM for expert slots: %.2f GiB free - dense %.2f - KV %.2f - staging %.2f"
        " - reserve %.2f = %.2f GiB", free / GiB, dense * size / GiB, kv / GiB, staging / GiB,
        store.vram_reserve_gib, max(left, 0) / GiB,
    )  # fmt: skip
    return int(max(left, 0) // layout.nbytes)


def _pin_settings(config: Config, on_progress: ProgressFn | None) -> dict[str, Any]:
    def report(done: int, total: int, elapsed: float, chunks: tuple[int, int]) -> None:
        if on_progress is not None:
            on_progress(PinProgress(done, total, chunks[0], chunks[1], elapsed))

    return {
        "chunk_bytes": config.store.pin_chunk_mib * MiB,
        "rate_bytes_s": config.store.pin_rate_gbps * 1e9,
        "on_progress": report,
    }
