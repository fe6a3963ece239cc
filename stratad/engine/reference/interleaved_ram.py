"""The cpu engine's RAM copies of experts with their rows interleaved in eights.

The one-call MoE layers (`kernels/cpu/moe_layers.h`) read each routed expert where the store
says it lies (`ExpertStore.in_place`). The kernels read a weight fastest in rows interleaved
in eights (`kernels/cpu/interleave.h`: one VNNI dot for four values of eight rows), as the
cpu engine holds its dense weights; here the store's RAM copies are made in that layout as
they are pinned, while the experts still in the file are read as GGUF rows (each part's type
code goes with its address). The copy is made from the blob as read, one expert
at a time on the pinner's thread (one kernel thread: pinning is paced, serving goes on).

A part whose type has no interleaved layout stays in its GGUF bytes; the copy's parts lie at
fixed offsets of the slot (64-byte aligned), its size a multiple of the page. The plan sizes
the RAM tier with these sizes (`InterleavedExperts.stride`), so the budget holds what is
pinned. Chosen by `ram_form` where every copy is read only by the one-call layers.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

from kernels.cpu.experts import CpuExperts
from stratad.engine.reference.cpu_stacks import one_call_moe
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.archs import ARCHS
from stratad.model.spec import ExpertUnit, Model
from stratad.store.pack.manifest import ExpertBytes, ExpertLayout
from stratad.store.placement.plan import Stage
from stratad.store.tiers.ram_form import BlobReader, Codes, RamForm
from stratad.store.tiers.sources import ExpertSource

ALIGN = 64  # each part of a copy starts on a cache line


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class InterleavedExperts:
    """RAM copies whose parts are interleaved in eights where their type allows."""

    name = "interleaved in eights"
    as_file = False

    def __init__(self, kernels: CpuExperts, layouts: Sequence[ExpertLayout]) -> None:
        self.kernels, self.layouts = kernels, tuple(layouts)
        # per layer: each part's (offset in the copy, interleaved bytes or -1: as in the file)
        self._parts: list[tuple[tuple[int, int], ...]] = []
        self._strides: list[int] = []
        for layout in self.layouts:
            parts, at = [], 0
            for t in layout.projections:
                rows, cols = t.shape
                x8 = kernels.interleaved_bytes(t.qt, rows, cols)
                parts.append((at, x8))
                at = _round(at + max(x8, t.nbytes), ALIGN)
            self._parts.append(tuple(parts))
            self._strides.append(_round(at, mmap.PAGESIZE))
        self._staging = torch.empty(0, dtype=torch.uint8)  # the pinner's, one blob

    def stride(self, layer: int) -> int:
        return self._strides[layer]

    def fill(self, source: BlobReader, unit: ExpertUnit, slot: torch.Tensor) -> Codes:
        layout = self.layouts[unit.layer]
        if self._staging.numel() < layout.stride:
            self._staging = torch.empty(layout.stride, dtype=torch.uint8)
        blob = self._staging[: layout.stride]
        source.read_into(unit.layer, unit.expert, blob)
        codes = []
        for t, (at, x8) in zip(layout.projections, self._parts[unit.layer], strict=True):
            raw = blob[t.offset : t.offset + t.nbytes]
            if x8 < 0:
                slot[at : at + t.nbytes].copy_(raw)
                codes.append(int(t.qt))
                continue
            rows, cols = t.shape
            codes.append(self.kernels.interleave_into(raw, t.qt, rows, cols,
                                                      slot[at : at + x8], threads=1))  # fmt: skip
        return codes[0], codes[1], codes[2]

    def parts(self, layer: int, slot: torch.Tensor) -> ExpertBytes:
        tensors = self.layouts[layer].projections
        g, u, d = (slot[at : at + (t.nbytes if x8 < 0 else x8)]
                   for t, (at, x8) in zip(tensors, self._parts[layer], strict=True))  # fmt: skip
        return g, u, d


def ram_form(
    weights: QuantWeights, model: Model, source: ExpertSource, stages: Sequence[Stage]
) -> RamForm | None:
    """The cpu engine's RAM form for `model`'s experts: interleaved where the kernels have that
    layout, no expert has a VRAM slot, every expert of the source can be read in place (a GGUF's
    mapping, not a pack's copies) and the model's layers run in one call (the only reader of
    such copies); else None (the copies as in the file)."""
    kernels = weights.kernels
    if not (kernels.interleaves and weights.one_call) or any(s.slots for s in stages):
        return None
    if source.mapped(0, 0) is None:
        return None
    layers = [ARCHS[model.spec.arch].layer(model, i) for i in range(model.spec.n_layers)]
    if not one_call_moe(kernels, weights.reads, model.spec, layers):
        return None
    return InterleavedExperts(kernels, source.layouts)
