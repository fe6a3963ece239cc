"""Which forward pass serves a model, and how the offload engine is started.

`reference`: the torch reference forward; a MoE model's experts come through the expert store
(`stratad.store`), on any device. `offload`: the GPU engine for MoE models larger than VRAM
(`stratad.engine.offload.forward`): the hottest experts in VRAM slots, the plan's RAM copies in the
store's page-locked arena (pinned at a paced rate while the engine loads), the rest read from
the model file on a miss; misses cross PCIe (`engine.gpu_miss`). Both start from the same
deterministic residency plan, so the plan hash, the coverage line and the control socket's views
mean the same thing.
"""

from __future__ import annotations

import logging
import time

from stratad.config import Config
from stratad.engine.kv_format import FORMATS
from stratad.engine.offload.cpu_misses import balanced_frac
from stratad.engine.offload.experts import kernel_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.kernel_form import KernelForm
from stratad.engine.offload.kernel_table import model_shapes, tuned
from stratad.engine.offload.stages import StagedForward
from stratad.engine.offload.switches import Chosen, dense_form, miss_paths, q6_k_layout
from stratad.engine.placement import StartPlan, kv_window
from stratad.engine.timing import StageTimer
from stratad.model.spec import Model
from stratad.store.addressed import AddressedStore
from stratad.store.placement.bandwidth import Bandwidths
from stratad.store.placement.hostmem import cores, read_bps
from stratad.store.sizes import MiB
from stratad.store.startup import plan_and_admit
from stratad.store.tiers.pinning import PinSettings, ProgressFn
from stratad.store.tiers.rows import PinnedRows, gpu_lock
from stratad.store.tiers.slots import SlotSettings
from stratad.store.tiers.sources import ExpertSource

log = logging.getLogger("stratad.engine")


def open_offload(
    config: Config,
    model: Model,
    start: StartPlan,
    source: ExpertSource,
    timer: StageTimer,
    on_pin_progress: ProgressFn | None = None,
) -> tuple[OffloadForward | StagedForward, AddressedStore]:
    """Plan (the store's one placement function on the start's stages), admit (wait for the
    RAM), fill and pin, then build."""
    started = plan_and_admit(config.store, source, stages=start.stages,
                             compute_device=start.devices[0], reserves=start.reserves)  # fmt: skip
    plan, inputs, bw = started.plan, started.planned.inputs, started.bandwidths
    ram = plan.in_ram()  # the RAM tier; the rest are read from the file when routed
    device = start.devices[0]
    found = start.kernels or tuned(device.type, model_shapes(model.spec))
    log.log(found.level, "%s", found.message)
    paths = miss_paths(config.engine, found.switches, found.table)
    q6_k = q6_k_layout(found.switches, found.configs, found.table)
    dense = dense_form(found.switches, found.table)
    log.info("%s, q6_k_layout %s, dense_form %s", paths.line(), q6_k, dense)
    layouts = kernel_layouts(model, q6_k.value == "split")
    log.info(
        "experts hold %s: the fused kernels read them (Q4_0 split, Q6_K %s, the rest as GGUF"
        " blocks)", ", ".join(q.name for q in layouts.qtypes()),
        "split" if q6_k.value == "split" else "as blocks",
    )  # fmt: skip
    cfg = OffloadConfig(
        expert_vram_bytes=len(plan.vram) * layouts.slot_bytes, max_context=start.max_context,
        dtype=start.dtype, graphs=device.type == "cuda" and not timer.enabled,
        prefill_chunk=config.engine.offload_prefill_chunk,
        slots=SlotSettings(config.store.cache_policy), gpu_miss=paths.gpu_miss.value,
        kernels=found.configs, prefetch=paths.prefetching,
        cpu_threads=config.engine.cpu_expert_threads or config.engine.threads or None,
        kv_format=FORMATS[config.engine.kv_cache], q6_k_split=q6_k.value == "split",
        kv_resident=kv_window(config.engine.kv_resident, start.max_context),
        dense_gguf=dense.value == "gguf",
    )  # fmt: skip
    t0 = time.monotonic()
    forward: OffloadForward | StagedForward
    # the RAM tier, read through the store's source (a pack's checksums are verified there),
    # filled and page-locked by the store's paced pinner while the engine loads
    lock = gpu_lock(device)
    if lock.locker.gpu_registered and config.store.lock not in ("auto", "gpu"):
        log.warning(
            "store.lock = %s: the GPU engine registers its RAM tier with the GPU"
            " runtime all the same (its kernels read it in place)",
            config.store.lock,
        )
    pin = PinSettings(config.store.pin_chunk_mib * MiB, config.store.pin_rate_gbps * 1e9)
    rows = PinnedRows(source, KernelForm(source.layouts, layouts), ram, lock, pin,
                      on_pin_progress)  # fmt: skip
    store = AddressedStore(rows, plan, counts=inputs.counts, bandwidths=bw,
                           budget=started.planned.budget, degraded=started.degraded)  # fmt: skip
    if len(start.devices) == 1:
        forward = OffloadForward(model, device, cfg, residents=plan.residents(), store=store)
    else:
        forward = StagedForward(model, start.devices, plan.bounds, cfg, residents=plan.residents(),
                                store=store)  # fmt: skip
    forward.timer = timer
    forward.set_pcie_frac(_pcie_frac(config.engine.pcie_frac, paths.cpu_split, forward, bw))
    log.info(
        "decode misses: the GPU takes %.0f%% (%s), the CPU the rest",
        100 * forward.config.pcie_frac,
        "fetched into VRAM" if cfg.gpu_miss == "copy" else "read in place",
    )
    log.info("offload engine ready in %.1f s", time.monotonic() - t0)
    return forward, store


def _pcie_frac(
    setting: float | str, split: Chosen, forward: OffloadForward | StagedForward, bw: Bandwidths
) -> float:
    """The miss policy: the configured share; `balanced`, or `auto` where the switch
    `cpu_split` is `balanced`: the share balancing the measured rates (a split step waits
    for each layer's routing: at the H200's own link that cost more than the CPU's share
    saved), else 1. The host line says what the CPU's rate is measured against."""
    cpu, host = forward.measure_cpu_expert_bps(), read_bps()
    balanced = balanced_frac(cpu, bw.copy_bps)
    if setting not in ("auto", "balanced"):
        frac, why = float(setting), "engine.pcie_frac"
    else:
        frac = balanced if split.value == "balanced" else 1.0
        why = f"{setting}, cpu_split {split}"
    log.info(
        "host: memory read %.1f GB/s (%d threads); CPU experts %.2f GB/s (%.0f%% of it, %s);"
        " resident copy to the GPU %.2f GB/s; miss policy: pcie_frac %.2f (%s; the rates alone"
        " would give %.2f)",
        host / 1e9, cores(), cpu / 1e9, 100 * cpu / host, forward.cpu_math, bw.copy_bps / 1e9,
        frac, why, balanced,
    )  # fmt: skip
    return frac
