"""A pipeline of offload engines over several devices: a layer split.

Stage s runs layers [K_s, K_{s+1}) on its device with its own dense weights, KV cache,
expert slots and address table; every stage reads the same page-locked host copy of the
experts. The hidden state crosses from one stage to the next once per step (or prefill
chunk) with a plain copy: no peer-to-peer access is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from stratad.engine.batch import Seq, run_batch
from stratad.engine.kv import KVCache, KVPool
from stratad.engine.offload.config import kv_pool
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.passes import Decode, Pass
from stratad.engine.timing import StageTimer
from stratad.model.spec import Model, ModelError
from stratad.store.addressed import AddressedStore
from stratad.store.tiers.address_table import AddressTable

log = logging.getLogger("stratad.engine")


def parse_split(text: str, n_layers: int, n_stages: int) -> list[int]:
    """'24' or '24,24' (layers per stage) -> stage boundaries [0, 24, 48]."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"layer_split={text!r}: expected layer counts like 24,24") from None
    if len(counts) == n_stages - 1:
        counts.append(n_layers - sum(counts))
    if len(counts) != n_stages or any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise ValueError(
            f"layer_split={text!r}: {n_stages} stages need {n_stages} positive counts"
            f" summing to the model's {n_layers} layers"
        )
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def balanced_split(n_layers: int, capacities: Sequence[float]) -> list[int]:
    """Boundaries giving each stage layers in proportion to its capacity (e.g. free VRAM),
    at least one each; the same inputs give the same split."""
    total = sum(capacities)
    if total <= 0 or len(capacities) > n_layers:
        raise ValueError(f"cannot split {n_layers} layers over capacities {list(capacities)}")
    bounds, acc = [0], 0.0
    for i, cap in enumerate(capacities[:-1]):
        acc += cap
        lo = bounds[-1] + 1
        hi = n_layers - (len(capacities) - 1 - i)
        bounds.append(min(max(round(n_layers * acc / total), lo), hi))
    bounds.append(n_layers)
    return bounds


class StagedForward:
    """The offload engine as a pipeline of stages (one per device); same interface."""

    def __init__(
        self,
        model: Model,
        devices: Sequence[torch.device],
        bounds: Sequence[int],
        config: OffloadConfig,
        residents: list[list[int]] | None = None,
        ram: list[list[int]] | None = None,
        store: AddressedStore | None = None,
    ) -> None:
        if len(bounds) != len(devices) + 1 or bounds[0] != 0 or bounds[-1] != model.spec.n_layers:
            raise ModelError(
                f"stage bounds {list(bounds)} do not cover {model.spec.n_layers} layers"
            )
        self.spec = model.spec
        # each stage's share of the expert VRAM follows its share of the layers
        self.stages: list[OffloadForward] = []
        for device, lo, hi in zip(devices, bounds[:-1], bounds[1:], strict=True):
            share = config.expert_vram_bytes * (hi - lo) // model.spec.n_layers
            cfg = replace(config, expert_vram_bytes=share, graphs=False)
            # the RAM tier is page-locked for every GPU of the process (portable)
            stage = OffloadForward(model, torch.device(device), cfg, store=store,
                                   residents=residents, layers=range(lo, hi),
                                   ram=ram)  # fmt: skip
            store = stage.store
            self.stages.append(stage)
        self.config = config
        self.layer_device = [s.device for s in self.stages for _ in s.layer_ids]
        log.info(
            "layer split: %s",
            ", ".join(f"layers {s.layer_ids.start}-{s.layer_ids.stop - 1} on {s.device}"
                      for s in self.stages),
        )  # fmt: skip

    @property
    def timer(self) -> StageTimer:
        return self.stages[0].timer

    @timer.setter
    def timer(self, timer: StageTimer) -> None:
        for stage in self.stages:
            stage.timer = timer

    def set_pcie_frac(self, frac: float) -> None:
        self.config = replace(self.config, pcie_frac=frac)
        for stage in self.stages:
            stage.config = replace(stage.config, pcie_frac=frac)

    def measure_cpu_expert_bps(self) -> float:
        return self.stages[0].measure_cpu_expert_bps()

    @property
    def cpu_math(self) -> str:
        return self.stages[0].cpu_math

    @property
    def store(self) -> AddressedStore:
        return self.stages[0].store

    @property
    def tables(self) -> list[AddressTable]:
        """Each stage's slots, address table and counters."""
        return [s.experts for s in self.stages]

    @property
    def route_counts(self) -> torch.Tensor:
        """[L, E]: each stage counts its own layers."""
        return torch.stack([t.route_counts.cpu() for t in self.tables]).sum(0)

    def new_pool(self, tokens: int) -> KVPool:
        """A KV pool of at least `tokens` rows, each layer's on its stage's device."""
        return kv_pool(self.spec, tokens, self.layer_device, self.config)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """A cache of `max_len` tokens (the context) on a pool of its own."""
        n = max_len or self.config.max_context
        return KVCache(self.new_pool(n), n)

    @property
    def prefill_chunk(self) -> int:
        return self.config.prefill_chunk

    def run(
        self, tokens: list[int], pos: list[int], caches: Sequence[KVCache], step: Pass
    ) -> torch.Tensor:
        """Every stage over a pass, handing x from one device to the next (`batch.Layers`)."""
        first = self.stages[0]
        x = first.embed[torch.tensor(tokens, device=first.device)]
        for stage in self.stages:
            x = x.to(stage.device)
            x, ids = stage.run_layers(x, torch.tensor(pos, device=stage.device), caches, step)
            if step.decode:
                stage.experts.step(ids.reshape(ids.shape[0], -1))  # its counts and moves
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].head(x.to(self.stages[-1].device))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].final_norm(x.to(self.stages[-1].device))

    @property
    def row_tokens(self) -> int:
        return self.config.row_tokens

    def decode(
        self, tokens: list[int] | torch.Tensor, pos: list[int], caches: Sequence[KVCache]
    ) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):  # a pipeline reads its tokens on the host
            tokens = tokens.tolist()
        for stage in self.stages:
            stage.experts.apply()
        return self.head(self.run(tokens, pos, caches, Decode(len(caches))))

    @torch.inference_mode()
    def step(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        return run_batch(self, seqs)

    def __call__(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        return self.step([Seq.logits(cache, tokens, all_logits)])[0]
