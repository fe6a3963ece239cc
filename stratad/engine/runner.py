"""The model runner: a model, its forward pass and its experts' tiers, opened from the config.

`open_runner` loads the model, plans the start (`placement.start_plan`: which forward, the
layer split, the VRAM slots, the requests served at once, the host reserves), opens the
expert store (reference and cpu forwards) or the offload engine's tiers, and builds the
forward. `Runner.step` runs one batched forward: B sequences, each its own KV cache and its
next tokens. The runtime (`stratad.runtime.service`) decides what each step computes and
what its logits become; nothing here knows of requests.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stratad.config import Config, StepAhead
from stratad.engine import placement
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache, KVPool
from stratad.engine.kv_format import FORMATS
from stratad.engine.passes import FUSED_MAX_TOKENS
from stratad.engine.placement import StartPlan
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.interleaved_ram import ram_form
from stratad.engine.reference.weights_mode import cpu_weights
from stratad.engine.timing import StageTimer
from stratad.model.default import default_model_path
from stratad.model.graph.rope_scaling import UNSCALED, configured
from stratad.model.spec import Model
from stratad.store.addressed import AddressedStore
from stratad.store.loader import load_model
from stratad.store.startup import open_source, open_store, slot_bytes
from stratad.store.store import ExpertStore
from stratad.store.tiers.pinning import ProgressFn

if TYPE_CHECKING:  # the GPU engine's modules (and Triton's 71 MiB) load only where it runs
    from stratad.engine.offload.forward import OffloadForward
    from stratad.engine.offload.stages import StagedForward

log = logging.getLogger("stratad.engine")


@dataclass(frozen=True)
class Runner:
    """A loaded model and the forward that runs it."""

    path: Path
    model: Model
    device: torch.device
    start: StartPlan  # the engine, the split, the slots, the requests at once, the context
    forward: ReferenceForward | OffloadForward | StagedForward
    store: ExpertStore | AddressedStore | None  # the experts' tiers, as the control socket reads
    timer: StageTimer

    @property
    def backend(self) -> str:
        return self.start.backend

    def new_pool(self, tokens: int) -> KVPool:
        return self.forward.new_pool(tokens)

    @property
    def prompt_rows(self) -> tuple[int, int]:
        return prompt_rows(self.forward)

    def ahead(
        self, mode: StepAhead
    ) -> Callable[[list[KVCache], torch.Tensor], torch.Tensor] | None:
        return ahead_pass(self.forward, mode)

    def new_cache(self, max_len: int) -> KVCache:
        return self.forward.new_cache(max_len)

    def prepare(self, cache: KVCache) -> None:
        """Make ready what steps on caches like `cache` need before a request waits for it
        (the offload engine's decode graphs of every row count)."""
        if self.backend == "offload":
            from stratad.engine.offload.forward import OffloadForward

            if isinstance(self.forward, OffloadForward):
                self.forward.prepare(cache)

    def step(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        """One batched forward: each sequence's tokens appended to its cache; the logits of
        each one's last new token (of every new token where it asks)."""
        return self.forward.step(seqs)


def _replaying(
    forward: ReferenceForward | OffloadForward | StagedForward,
) -> OffloadForward | None:
    """The forward, where its decode pass replays a captured graph (the offload engine on a
    GPU); None where every pass is launched op by op."""
    if isinstance(forward, ReferenceForward):
        return None
    from stratad.engine.offload.forward import OffloadForward  # loaded: the forward is one

    return forward if isinstance(forward, OffloadForward) and forward.replays_decode else None


def prompt_rows(forward: ReferenceForward | OffloadForward | StagedForward) -> tuple[int, int]:
    """(the rows of the forward's one decode pass, the most tokens of one prompt it takes
    there as rows), where that pass replays a captured graph: short prompts then wait for
    room in it rather than run as a prefill pass launched op by op; (0, 0) elsewhere, where
    either pass is launched op by op."""
    replaying = _replaying(forward)
    if replaying is None or replaying.row_tokens <= 1:
        return 0, 0
    return FUSED_MAX_TOKENS, replaying.row_tokens


def ahead_pass(
    forward: ReferenceForward | OffloadForward | StagedForward, mode: StepAhead = "on"
) -> Callable[[list[KVCache], torch.Tensor], torch.Tensor] | None:
    """The forward's decode step from tokens still on the device (`batch.run_ahead`), where
    its decode pass replays a captured graph (that step queues behind the one that draws its
    tokens, and the device computes it while the host reads, samples and streams those) and
    `mode` (`engine.step_ahead`) takes it: "on" there, "auto" only where every expert holds a
    VRAM slot (with misses to fetch it measured slower), "off" never. None elsewhere, where
    the host launches every kernel itself and gains nothing."""
    replaying = _replaying(forward)
    if replaying is None or mode == "off":
        return None
    if mode == "auto" and not replaying.experts.complete:
        return None
    return replaying.step_ahead


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"engine.device={name!r} but no GPU is visible to torch")
    return device


def free_vram(config: Config, device: torch.device) -> list[int | None]:
    """Each engine GPU's free VRAM now (before the engine allocates): one per `engine.gpus`
    when they split the layers, else one for `device` (None on the CPU)."""
    if device.type != "cuda":
        return [None]
    gpus = config.engine.gpus if len(config.engine.gpus) >= 2 else [device.index]
    return [int(torch.cuda.mem_get_info(torch.device("cuda", g))[0]) for g in gpus]


def weight_types(model: Model) -> str:
    """The types the weights hold, most tensors first, the routed experts apart: "experts
    Q4_0 (12 stacks); the rest F32 (21 tensors), F16 (16), Q8_0 (2)"."""

    def counted(names: list[str], unit: str) -> str:
        counts = Counter(model.tensors[n].qtype.name for n in names)
        return ", ".join(f"{q} ({n}{f' {unit}' if i == 0 else ''})"
                         for i, (q, n) in enumerate(counts.most_common()))  # fmt: skip

    experts = [n for n in model.tensors if ".experts." in n]
    rest = counted([n for n in model.tensors if ".experts." not in n], "tensors")
    return f"experts {counted(experts, 'stacks')}; the rest {rest}" if experts else rest


def configured_model(model: Model, config: Config) -> Model:
    """The model as the configuration adjusts it (`model.rope_scaling`)."""
    m = config.model
    spec = configured(model.spec, m.rope_scaling, m.rope_scale, m.rope_original_context)
    return model if spec is model.spec else replace(model, spec=spec)


def open_runner(config: Config, on_pin_progress: ProgressFn | None = None) -> Runner:
    """Load the model and start its forward as the configuration and the machine say.

    MoE models read their experts through the store (planned tiers, paced pinning, coverage:
    stratad/store) or, on a GPU, run the offload engine from the same plan; both place them
    with the plan `stratactl check` computes. Dense models need neither."""
    path = Path(config.model.path) if config.model.path else default_model_path()
    device = pick_device(config.engine.device)
    if config.engine.threads:
        torch.set_num_threads(config.engine.threads)
    t0 = time.monotonic()
    model = configured_model(load_model(path), config)
    timer = StageTimer(enabled=config.engine.decode_timing)
    store_config = placement.store_config(config, path)
    source = open_source(store_config, model) if model.spec.is_moe else None
    start = placement.start_plan(config, model, device, free_vram(config, device),
                                 slot_bytes(source) if source else 0)  # fmt: skip
    forward: ReferenceForward | OffloadForward | StagedForward
    store: ExpertStore | AddressedStore | None = None
    if source is not None and start.backend == "offload":
        from stratad.engine.offload.start import open_offload

        forward, store = open_offload(config, model, start, source, timer, on_pin_progress)
    else:
        experts = None
        weights = cpu_weights(config.engine) if start.backend == "cpu" else None
        if source is not None:
            form = None if weights is None else ram_form(weights, model, source, start.stages)
            store = experts = open_store(store_config, source, compute_device=device,
                                         reserves=start.reserves, on_pin_progress=on_pin_progress,
                                         stages=start.stages, ram_form=form)  # fmt: skip
        forward = ReferenceForward(model, device, start.dtype, experts=experts, timer=timer,
                                   weights=weights,
                                   kv_format=FORMATS[config.engine.kv_cache])  # fmt: skip
        log.info("weights: %s; %s, %s", weight_types(model), forward.mode.name, forward.path)
    spec = model.spec
    scaled = "" if spec.rope_scaling == UNSCALED else f", RoPE {spec.rope_scaling.describe()}"
    log.info(
        "model %s loaded: arch %s, %d layers, %s on %s, context %d%s (%.1f s)",
        path,
        spec.arch,
        spec.n_layers,
        start.dtype,
        device,
        start.max_context,
        scaled,
        time.monotonic() - t0,
    )
    log.info("serving up to %d requests at once: %s", start.parallel.count,
             start.parallel.describe())  # fmt: skip
    return Runner(path, model, device, start, forward, store, timer)
