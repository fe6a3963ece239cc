"""What a start places, computed once for the daemon and for `stratactl check`.

The engine that will run (`choose_backend`), the layer split over the GPUs, each device's
VRAM slots, the requests served at once and the host reserves are functions of the
configuration, the model, the free VRAM readings and the host's RAM, and nothing else. The daemon
and the dry run both call `start_plan` and hand its stages to the store's one placement function
(`stratad.store.placement.plan.place`), so the plan hash that `check` prints is the one the daemon
runs, with auto slots and with a split.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from kernels.cpu import build as cpu_build
from kernels.cpu.dense import CACHE_DTYPE
from stratad.config import Config, StoreConfig
from stratad.engine.kv import resident_split
from stratad.engine.kv_format import FORMATS, KVFormat
from stratad.engine.passes import FETCH_MAX_TOKENS
from stratad.model.spec import Model, ModelError, ModelSpec
from stratad.store.loader import is_pack
from stratad.store.placement.admission import mem_total
from stratad.store.placement.plan import Stage, slot_count
from stratad.store.sizes import GiB
from stratad.store.startup import daemon_reserves

# The offload engine's planning helpers are imported where a plan for it is made: its modules
# bring Triton (71 MiB of a process), which a CPU host's daemon does without.
if TYPE_CHECKING:
    from stratad.engine.offload.kernel_table import Lookup

log = logging.getLogger("stratad.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_backend(name: str, model: Model, device: torch.device) -> str:
    """`auto` is the offload engine for a MoE model whose experts its kernels read, on a GPU;
    on a CPU, the `cpu` engine (the GGUF blocks read by the compiled CPU kernels) where a C
    compiler builds them, else the reference."""
    if name != "auto":
        if name == "offload" and not model.spec.is_moe:
            raise ModelError(f"{model.source}: engine.backend=offload serves MoE models only")
        if name == "offload" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ModelError(
                "engine.backend=offload on the CPU runs its kernels in Triton's interpreter"
                " (for tests): set TRITON_INTERPRET=1, or use a GPU"
            )
        if name == "offload":
            from stratad.engine.offload.experts import fast_path_refusal

            why = fast_path_refusal(model)
            if why is not None:
                raise ModelError(f"{model.source}: the offload engine cannot run it: {why}")
        if name == "cpu" and device.type != "cpu":
            raise ModelError(f"engine.backend=cpu computes on the CPU, not {device}")
        return name
    if device.type == "cuda" and offload_supported(model):
        return "offload"
    if device.type == "cuda" and model.spec.is_moe:
        from stratad.engine.offload.experts import fast_path_refusal

        log.warning(
            "the GPU engine cannot read this model's experts (%s): the reference engine"
            " serves it, much slower",
            fast_path_refusal(model),
        )
    if device.type == "cpu":
        try:
            cpu_build.load()
        except cpu_build.CpuKernelsUnavailable as err:
            log.warning("CPU kernels: %s; the reference engine serves the model from float32"
                        " copies of its weights (slower, more memory)", err)
            return "reference"
        return "cpu"
    return "reference"


def offload_supported(model: Model) -> bool:
    """A MoE model whose every expert projection the fused kernels read
    (`kernels.experts.moe.MOE_QTYPES`)."""
    from stratad.engine.offload.experts import fast_path_refusal

    return model.spec.is_moe and fast_path_refusal(model) is None


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`engine.dtype`: auto is float32 on the CPU, bfloat16 on a GPU."""
    if setting == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[setting]


@dataclass(frozen=True)
class Parallel:
    """Requests served at once: `server.parallel`, or (0, auto) as many working KV caches of
    the whole context as fit in `AUTO_KV_SHARE` of the memory they live in, at most
    `AUTO_MOST` and at least one, as llama-server sizes its slots; on a GPU (`shared`)
    `AUTO_MOST_GPU` requests sharing a KV pool of the whole contexts that fit there."""

    count: int
    kv_bytes: int  # one working cache: the whole context's keys and values
    memory: int | None  # what the caches live in (free VRAM, or the host's RAM); None: unread
    where: str  # "VRAM" or "RAM"
    auto: bool
    contexts: float = 0.0  # whole contexts the KV pool holds (`server.kv_cache_tokens`); 0: count
    shared: bool = False  # auto on a GPU: more requests than whole contexts in the pool

    @property
    def pool_contexts(self) -> float:
        return self.contexts or float(self.count)

    def pool_tokens(self, max_context: int) -> int:
        """The KV pool's tokens for the generator: those planned where the pool is smaller
        or larger than a whole context a request (configured, or shared on a GPU); 0 where
        it is exactly that (the generator then rounds each context to whole blocks, so
        none is ever preempted)."""
        whole = not self.contexts or (self.shared and self.contexts >= self.count)
        return 0 if whole else round(max_context * self.contexts)

    def describe(self) -> str:
        total = self.kv_bytes * self.pool_contexts / GiB
        pool = (f"{self.contexts:.3g} whole contexts (server.kv_cache_tokens)" if self.contexts
                else "the whole context of each")  # fmt: skip
        caches = f"a KV pool of {pool}, {total:.2f} GiB of {self.where}"
        if not self.auto:
            return f"{caches} (server.parallel)"
        if self.memory is None:
            return f"{caches} (server.parallel auto: {self.where} size unknown, one)"
        share = f"1/{round(1 / AUTO_KV_SHARE)} of {self.memory / GiB:.1f} GiB"
        if self.shared:
            return (f"a KV pool of {self.contexts:.3g} whole contexts shared by all, "
                    f"{total:.2f} GiB of {self.where} (server.parallel auto: {self.count} on a"
                    f" GPU, the pool what fits in {share}; when it runs short the newest"
                    " requests give their blocks back and compute them again later)")  # fmt: skip
        return (f"{caches} (server.parallel auto: at most {AUTO_MOST}, the caches within"
                f" {share})")  # fmt: skip


AUTO_MOST = 4  # requests at once that `server.parallel = 0` chooses at most on a CPU
# ... and on a GPU, where a decode step of 8 sequences gave 2.8x one's tokens and of 32 3.9x
# (bench/results/2026-12-06-h100-r19.md), and the KV blocks are shared: the pool holds the
# whole contexts that fit in AUTO_KV_SHARE of the VRAM (at least one, at most one each), and
# requests that outgrow it are preempted (`stratad/runtime/kv_plan.py`)
AUTO_MOST_GPU = 16
AUTO_KV_SHARE = 1 / 8  # the memory the working KV caches may take when it chooses


def parallel_for(
    configured: int,
    kv_bytes: int,
    memory: int | None,
    where: str,
    contexts: float = 0.0,
    shared: bool = False,
) -> Parallel:
    """`contexts`: the KV pool's size in whole contexts when `server.kv_cache_tokens` sets it
    (at least one); 0: a whole context per request. `shared`: an auto count serves
    `AUTO_MOST_GPU` requests from a pool of what fits (the offload engine on a GPU)."""
    contexts = max(contexts, 1.0) if contexts else 0.0
    if configured:
        return Parallel(configured, kv_bytes, memory, where, auto=False, contexts=contexts)
    fits = max(1 if memory is None else int(memory * AUTO_KV_SHARE) // max(kv_bytes, 1), 1)
    if shared:
        pool = contexts or float(min(fits, AUTO_MOST_GPU))
        return Parallel(AUTO_MOST_GPU, kv_bytes, memory, where, auto=True, contexts=pool,
                        shared=True)  # fmt: skip
    return Parallel(min(fits, AUTO_MOST), kv_bytes, memory, where, auto=True, contexts=contexts)


@dataclass(frozen=True)
class StartPlan:
    """Everything a start plans from, besides the expert source and the host's MemTotal."""

    backend: str  # "offload", "cpu" or "reference"
    devices: tuple[torch.device, ...]  # one per stage
    stages: tuple[Stage, ...]  # layers and VRAM slots of each device
    reserves: tuple[tuple[str, int], ...]  # host RAM besides the resident set
    dtype: torch.dtype
    max_context: int
    parallel: Parallel
    # the offload engine's tuning table (its launch settings and switches), looked up once
    kernels: Lookup | None = None


def store_config(config: Config, path: Path) -> StoreConfig:
    """`config.store`, with `pack` set when the model path is a pack (its experts.bin is
    read and verified)."""
    if is_pack(path) and not config.store.pack:
        return msgspec.structs.replace(config.store, pack=str(path))
    return config.store


def start_plan(
    config: Config,
    model: Model,
    device: torch.device,
    free_vram: Sequence[int | None],
    source_slot_bytes: int,
    host_bytes: int | None = None,
) -> StartPlan:
    """The start's plan inputs for `device`; `free_vram`: each GPU's free bytes before the
    engine allocates (one per `engine.gpus`, or one for `device`; None: no reading);
    `source_slot_bytes`: the largest blob stride of the expert source (the store's slot);
    `host_bytes`: the host's RAM (MemTotal or the cgroup limit, read when None), which sizes
    an auto `server.parallel` on a CPU."""
    spec = model.spec
    backend = choose_backend(config.engine.backend, model, device)
    if config.engine.kv_resident and not (backend == "offload" and device.type == "cuda"):
        log.warning("engine.kv_resident applies to the offload engine on a GPU; the %s engine"
                    " keeps every KV block where it runs", backend)  # fmt: skip
    if config.engine.kv_cache != "plain" and backend == "reference":
        raise ModelError(
            f"engine.kv_cache = {config.engine.kv_cache}: the reference engine keeps plain KV"
            " (int8 and 4-bit KV are the offload and cpu engines')"
        )
    dtype = compute_dtype(config.engine.dtype, device)
    max_context = min(config.model.max_context, spec.context_length)
    pool = config.server.kv_cache_tokens / max_context  # whole contexts; 0: one per request
    store = config.store
    gpus = config.engine.gpus if backend == "offload" and device.type == "cuda" else []
    if len(gpus) >= 2:
        devices = tuple(torch.device("cuda", g) for g in gpus)
        frees = list(free_vram)
        if len(frees) != len(devices):
            raise ValueError(f"{len(frees)} VRAM readings for {len(devices)} GPUs")
        bounds = split_bounds(config.engine.layer_split, spec.n_layers, frees)
    else:
        devices, bounds = (device,), [0, spec.n_layers]
        frees = [free_vram[0] if free_vram else None]
    if device.type != "cuda":
        frees = [None] * len(devices)
    reserve, n, cache = int(store.vram_reserve_gib * GiB), spec.n_layers, store.expert_cache
    stages, found, kv_host, kv_label = [], None, 0, "KV caches (server.parallel)"
    if backend == "offload":
        from stratad.engine.offload.config import pool_spec, values_are_keys
        from stratad.engine.offload.dense import blocks_saving
        from stratad.engine.offload.experts import blob_layouts
        from stratad.engine.offload.kernel_table import model_shapes, tuned
        from stratad.engine.offload.projection import SCRATCH_BYTES
        from stratad.engine.offload.switches import dense_form, miss_paths
        from stratad.engine.recurrent import state_bytes

        blob = blob_layouts(model).slot_bytes
        size = torch.finfo(dtype).bits // 8
        found = tuned(device.type, model_shapes(spec))
        prefetch = miss_paths(config.engine, found.switches, found.table).prefetching
        blocks = dense_form(found.switches, found.table).value == "gguf"
        known = [f for f in frees if f is not None]
        per_token = kv_token_bytes(pool_spec(spec), dtype, FORMATS[config.engine.kv_cache],
                                   values_are_keys(spec))  # fmt: skip
        window = kv_window(config.engine.kv_resident, max_context)
        # what a request holds in VRAM: its whole context, or its resident window
        parallel = parallel_for(config.server.parallel, (window or max_context) * per_token,
                                sum(known) if known else None, "VRAM", pool,
                                shared=device.type == "cuda")  # fmt: skip
        # the KV pool: a whole context per request served at once, or what is configured;
        # with a resident window, the older blocks in page-locked RAM
        first, in_ram = resident_split(int(max_context * parallel.pool_contexts), max_context,
                                       window, config.engine.offload_prefill_chunk)  # fmt: skip
        kv_host = in_ram * per_token
        kv_label = "KV blocks beyond the resident window (engine.kv_resident), page-locked"
        # a recurrent model's states: one a request served at once, and the decode step's
        # scratch for its padding rows (`linear_attention`)
        states = (parallel.count + 1) * state_bytes(spec)
        for lo, hi, free in zip(bounds[:-1], bounds[1:], frees, strict=True):
            # (less the scratch a prefill step dequantizes a projection's slices into)
            saved = blocks_saving(model, range(lo, hi), size) - SCRATCH_BYTES if blocks else 0
            engine = offload_vram_bytes(spec, model.dense_values(), blob, size,
                                        first * per_token + states, prefetch,
                                        (hi - lo) / n, saved)  # fmt: skip
            # a configured count is the total, shared by the stages as their layers
            slots = (
                cache * hi // n - cache * lo // n
                if cache != "auto"
                else slot_count(cache, free, reserve + engine, blob)
            )
            stages.append(Stage(range(lo, hi), slots))
        dense_host = 0
    else:
        # the store's layers: the MoE layers, past any leading dense ones
        stages.append(Stage(range(n - spec.dense_layers),
                            slot_count(cache, frees[0], reserve, source_slot_bytes)))  # fmt: skip
        # the reference holds float32 copies; the cpu engine reads the file's blocks (about a
        # byte per value or less, memory-mapped)
        per_value = {"reference": 4, "cpu": 1}.get(backend, 0) if device.type == "cpu" else 0
        dense_host = model.dense_values() * per_value
        # the working KV caches: halves (or int8 and their scales) in the cpu engine's one call
        kv_dtype = CACHE_DTYPE if backend == "cpu" else dtype
        one = max_context * kv_token_bytes(spec, kv_dtype, FORMATS[config.engine.kv_cache])
        if device.type == "cpu":
            host = host_bytes if host_bytes is not None else mem_total()[0]
            parallel = parallel_for(config.server.parallel, one, host, "RAM", pool)
            kv_host = int(one * parallel.pool_contexts)
        else:
            parallel = parallel_for(config.server.parallel, one, frees[0], "VRAM", pool)
    return StartPlan(
        backend, devices, tuple(stages),
        tuple(daemon_reserves(config, dense_host, kv_host, kv_label)),
        dtype, max_context, parallel, found,
    )  # fmt: skip


def split_bounds(setting: str, n_layers: int, free: Sequence[int | None]) -> list[int]:
    """The layer split: the configured counts, or (auto) in proportion to free VRAM."""
    from stratad.engine.offload.stages import balanced_split, parse_split

    if setting != "auto":
        return parse_split(setting, n_layers, len(free))
    return balanced_split(n_layers, [float(f or 0) for f in free])


def kv_window(setting: int, max_context: int) -> int:
    """`engine.kv_resident` as the offload engine keeps it: 0 (all in VRAM) where it is 0 or
    reaches the whole context."""
    return setting if 0 < setting < max_context else 0


def kv_token_bytes(
    spec: ModelSpec, dtype: torch.dtype, fmt: KVFormat, values_are_keys: bool = False
) -> int:
    """Bytes of one token's keys and values over every layer, as `fmt` stores them
    (`engine.kv_cache`): in `dtype`, int8 with a float32 scale per KV head, or 4-bit with a
    float16 scale and minimum per 32 values; the keys alone where they are the values too."""
    per_head = fmt.layout(spec.head_dim, dtype).nbytes
    if not values_are_keys:
        per_head += fmt.layout(spec.value_dim, dtype).nbytes
    return spec.kv_layers * spec.n_kv_heads * per_head


def offload_vram_bytes(
    spec: ModelSpec,
    dense_values: int,
    blob_bytes: int,
    dtype_bytes: int,
    kv_bytes: int,
    prefetch: bool,
    layer_share: float = 1.0,
    dense_saved: int = 0,
) -> int:
    """What the offload engine allocates in VRAM besides its expert slots, for the share of
    the layers one device runs: dense weights, the KV caches (`kv_bytes`: the pool's over
    every layer, a whole context per request served at once or as configured), the two
    prefill staging buffers
    (two layers of blobs in flight, one dequantized for the grouped GEMMs) and the decode
    fetch staging (top-k blobs for each of a fused pass's first FETCH_MAX_TOKENS tokens, and
    two layers' guesses when prefetching). `dense_saved`: what holding the dense projections
    as GGUF blocks saves on these layers (`dense.blocks_saving`)."""
    dense = layer_share * dense_values * dtype_bytes - dense_saved
    kv = layer_share * kv_bytes
    fetched = (FETCH_MAX_TOKENS + (2 if prefetch else 0)) * spec.n_experts_used * blob_bytes
    dequantized = 3 * spec.n_experts * spec.hidden * spec.expert_ffn * dtype_bytes
    staging = 2 * spec.n_experts * blob_bytes + dequantized + fetched
    return int(dense + kv + staging)
