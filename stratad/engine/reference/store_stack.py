"""The cpu engine's one-call MoE layers over the expert store's experts as they lie.

`kernels.cpu.moe_stack.MoEStack` runs every layer of a step in one kernel call, the router
included, so no fetch can happen between a layer's routing and its experts. Where the store can
say where every expert of a layer lies without a fetch (`ExpertStore.in_place`: its RAM copy
once pinned, else the GGUF's mapping; no VRAM slots), each layer's experts are handed to the
call as an address table, and the store counts what each step used by tier afterwards, as it
counts the per-layer path's fetches. The tables follow the pinning: a layer whose RAM copies
were pinned since the last step is addressed anew (the file's pages before, the locked copy
after). A store that must fetch (a pack's file tier, VRAM slots) keeps the per-layer path
(`stratad/engine/reference/store_moe.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.cpu.dense import CacheSpan
from kernels.cpu.moe_stack import MoEStack
from stratad.engine.reference.store_moe import ExpertProvider
from stratad.store.store import InPlace


def _table(experts: Sequence[InPlace]) -> np.ndarray:
    return np.array([[p.data_ptr() for p in x.parts] for x in experts], dtype=np.uint64)


def _codes(experts: Sequence[InPlace]) -> np.ndarray:
    return np.array([x.codes for x in experts], dtype=np.int32)


class StoreStack:
    """`MoEStack`'s call, the experts from the store (`attach` says whether it can)."""

    def __init__(self, stack: MoEStack, store: ExpertProvider) -> None:
        self.stack, self.store = stack, store
        n = len(stack.layers)
        self._ready = [-1] * n  # each layer's pinned copies when its table was made
        self._version = -1  # the store's ready_version when the tables were last checked
        self._tiers: list[list[str]] = [[] for _ in range(n)]
        self._keep: list[object] = [None] * n  # the tensors the tables point into

    @classmethod
    def attach(cls, stack: MoEStack, store: ExpertProvider) -> StoreStack | None:
        """The stack over `store`'s experts, or None where the store must fetch them."""
        out = cls(stack, store)
        return out if out._refresh() else None

    def _refresh(self) -> bool:
        """Address anew each layer whose pinned copies changed; False if one cannot be. Once
        pinning is done (the store's ready_version still), one comparison a step."""
        version = self.store.ready_version()
        if version == self._version:
            return True
        for layer, seen in enumerate(self._ready):
            ready = self.store.ready_in(layer)
            if ready == seen:
                continue
            experts = self.store.in_place(layer)
            if experts is None:
                return False
            self.stack.place_experts(layer, _table(experts), _codes(experts))
            self._tiers[layer] = [x.tier for x in experts]
            self._keep[layer], self._ready[layer] = experts, ready
        self._version = version
        return True

    def __call__(
        self, x: torch.Tensor, spans: Sequence[CacheSpan], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`MoEStack.__call__`; then each layer's distinct routed experts counted by tier."""
        if not self._refresh():
            raise RuntimeError("the expert store can no longer address every expert in place")
        routed = self.stack(x, spans, cos, sin)
        for layer, ids in enumerate(routed):
            tiers = self._tiers[layer]
            self.store.count(layer, [tiers[e] for e in set(ids.flatten().tolist())])
        return routed
