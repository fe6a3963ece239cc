"""A MoE layer's routed experts from the expert store, on the cpu engine: one kernel call a step.

The reference asks the store for one expert at a time and multiplies its dequantized weights;
the cpu engine asks for a step's distinct experts together (`ExpertStore.use_experts`: a VRAM
slot, the RAM copy, or the file: a GGUF's mapping read in place, a pack's blob read) and hands
every (token, slot) of the step to the kernels in one call, on the GGUF bytes themselves. An
expert routed by several tokens of a prompt is read once. The misses are admitted after the
call, so no admission refills a slot the call reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kernels.cpu.experts import PLAIN, CpuExperts, ExpertExtras
from kernels.formats.quant import QType
from stratad.model.weights import MLPWeights
from stratad.store.pack.manifest import ExpertBytes, ExpertLayout
from stratad.store.store import InPlace


class ExpertProvider(Protocol):
    """Where routed experts come from instead of the model's stacks (the expert store)."""

    @property
    def layouts(self) -> Sequence[ExpertLayout]: ...

    def get(self, layer: int, expert: int) -> MLPWeights: ...

    def use_experts(
        self, layer: int, experts: Sequence[int], use: Callable[[list[ExpertBytes]], None]
    ) -> None: ...

    def in_place(self, layer: int) -> list[InPlace] | None: ...

    def ready_version(self) -> int: ...

    def ready_in(self, layer: int) -> int: ...

    def count(self, layer: int, tiers: Sequence[str]) -> None: ...


def kernel_types(layout: ExpertLayout, kernels: CpuExperts) -> tuple[QType, QType, QType] | None:
    """The (gate, up, down) types when the kernels read the layer's experts, else None (a
    type outside `kernels.supported`, or rows not a multiple of 32): that layer goes expert
    by expert, as the reference does."""
    gate, up, down = layout.projections
    qtypes = (gate.qt, up.qt, down.qt)
    ffn, hidden = gate.shape[-2], gate.shape[-1]
    readable = set(qtypes) <= kernels.supported and not (hidden % 32 or ffn % 32)
    return qtypes if readable else None


class StoreExperts:
    """out[t] += sum_k weights[t, k] * expert ids[t, k](x[t]) for a layer whose experts the
    store serves, in one kernel call per step (`reads(layer)` says where it can)."""

    def __init__(self, store: ExpertProvider, kernels: CpuExperts) -> None:
        self.store, self.kernels = store, kernels
        self.qtypes = [kernel_types(lay, kernels) for lay in store.layouts]
        self.ffn = [lay.gate.shape[-2] for lay in store.layouts]

    def reads(self, layer: int) -> bool:
        return self.qtypes[layer] is not None

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor, extras: ExpertExtras = PLAIN) -> None:  # fmt: skip
        """x, out [T, hidden] float32 on the CPU; ids [T, k] expert ids, weights [T, k];
        `extras`: the items' (ids in row order) biases and clamped SwiGLU."""
        qtypes = self.qtypes[layer]
        if qtypes is None:
            raise ValueError(f"layer {layer}: the CPU kernels do not read its experts' types")
        rows, wts = ids.tolist(), weights.float().tolist()
        experts = sorted({e for row in rows for e in row})  # the reference's order
        index = {e: i for i, e in enumerate(experts)}
        items = [(t, index[e], wts[t][k]) for t, row in enumerate(rows) for k, e in enumerate(row)]

        tokens, item_weights = [t for t, _, _ in items], [w for _, _, w in items]

        def use(parts: list[ExpertBytes]) -> None:
            chosen = [parts[i] for _, i, _ in items]
            self.kernels.moe_parts(x, chosen, tokens, item_weights, qtypes, self.ffn[layer], out,
                                   extras)  # fmt: skip

        self.store.use_experts(layer, experts, use)
