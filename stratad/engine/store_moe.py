"""A MoE layer's routed experts from the expert store, on the cpu engine: one kernel call a step.

The reference asks the store for one expert at a time and multiplies its dequantized weights;
the cpu engine asks for a step's distinct experts together (`ExpertStore.use_blobs`: VRAM
slot, RAM copy or the file, each counted by its tier) and hands every (token, slot) of the step
to the kernels' `moe` in one call, on the blobs' own bytes. An expert routed by several tokens
of a prompt is read once. The misses are admitted after the call, so no admission evicts a
slot the call reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kernels.cpu_experts import CpuExpertFormat, CpuExperts
from stratad.model.weights import MLPWeights
from stratad.store.manifest import ExpertLayout


class ExpertProvider(Protocol):
    """Where routed experts come from instead of the model's stacks (the expert store)."""

    @property
    def layouts(self) -> Sequence[ExpertLayout]: ...

    def get(self, layer: int, expert: int) -> MLPWeights: ...

    def use_blobs(
        self, layer: int, experts: Sequence[int], use: Callable[[list[torch.Tensor]], None]
    ) -> None: ...


def kernel_format(layout: ExpertLayout, kernels: CpuExperts) -> CpuExpertFormat | None:
    """What the kernels read in a blob of `layout`, or None where they do not read it (a type
    outside `kernels.supported`, rows not a multiple of 32, or projections not back to back
    from the blob's start): that layer goes expert by expert, as the reference does."""
    gate, up, down = layout.projections
    qtypes = (gate.qt, up.qt, down.qt)
    ffn, hidden = gate.shape[-2], gate.shape[-1]
    fmt = CpuExpertFormat(qtypes, hidden, ffn, up.offset, down.offset, q4_0_split=False)
    readable = set(qtypes) <= kernels.supported and not (hidden % 32 or ffn % 32)
    packed = gate.offset == 0 and down.offset + down.nbytes == fmt.nbytes <= layout.nbytes
    return fmt if readable and packed else None


class StoreExperts:
    """out[t] += sum_k weights[t, k] * expert ids[t, k](x[t]) for a layer whose experts the
    store serves, in one `moe` call per step (`reads(layer)` says where it can)."""

    def __init__(self, store: ExpertProvider, kernels: CpuExperts) -> None:
        self.store, self.kernels = store, kernels
        self.formats = [kernel_format(lay, kernels) for lay in store.layouts]

    def reads(self, layer: int) -> bool:
        return self.formats[layer] is not None

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor) -> None:  # fmt: skip
        """x, out [T, hidden] float32 on the CPU; ids [T, k] expert ids, weights [T, k]."""
        fmt = self.formats[layer]
        if fmt is None:
            raise ValueError(f"layer {layer}: the CPU kernels do not read its expert blobs")
        rows, wts = ids.tolist(), weights.float().tolist()
        experts = sorted({e for row in rows for e in row})  # the reference's order
        index = {e: i for i, e in enumerate(experts)}
        items = [(t, index[e], wts[t][k]) for t, row in enumerate(rows) for k, e in enumerate(row)]

        def use(blobs: list[torch.Tensor]) -> None:
            self.kernels.moe(x, [blobs[i] for _, i, _ in items], [t for t, _, _ in items],
                             [w for _, _, w in items], fmt, out)  # fmt: skip

        self.store.use_blobs(layer, experts, use)
