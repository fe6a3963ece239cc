"""Routed experts as blobs: one contiguous [gate | up | down] block run per (layer, expert).

This is the unit every tier holds: a VRAM slot, the resident RAM copy and the pack file all
store the same bytes, so moving an expert is one copy and a kernel finds its three
matrices at fixed offsets from one address. Each projection keeps its GGUF type (Q4_0 and
MXFP4 in the kernels' split layouts, Q6_K too where the tuning table says it pays:
`kernel_layouts`); the
types, and so the offsets, may change from layer to layer, and every tier gives a blob the
same row (`ExpertLayouts.slot_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from kernels.experts.moe import (
    MOE_QTYPES,
    ExpertFormat,
    split_mxfp4,
    split_mxfp4_ok,
    split_q4_0,
    split_q4_0_ok,
    split_q6_k,
    unsplit_mxfp4,
    unsplit_q4_0,
    unsplit_q6_k,
)
from kernels.formats.quant import QTensor, QType, dequantize
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelError
from stratad.model.weights import MoEWeights
from stratad.store.pack.manifest import ExpertLayout

# the types a layout with `split` holds in their split layouts
SPLIT_QTYPES = frozenset({QType.Q4_0, QType.MXFP4})


@dataclass(frozen=True)
class BlobLayout:
    """Byte offsets and GGUF types of the three matrices inside one layer's expert blob."""

    qtypes: tuple[QType, QType, QType]  # gate, up, down
    hidden: int
    ffn: int
    gate_bytes: int  # [F, H] blocks
    up_bytes: int  # [F, H]
    down_bytes: int  # [H, F]
    # Q4_0 and MXFP4 projections in the kernels' split layouts (kernels.experts.moe.split_q4_0,
    # split_mxfp4)
    split: bool = False
    # Q6_K projections in theirs (kernels.experts.moe.split_q6_k: the int8 dots alone read
    # it); set only where the layer holds Q6_K
    q6_k_split: bool = False

    @property
    def up_offset(self) -> int:
        return self.gate_bytes

    @property
    def down_offset(self) -> int:
        return self.gate_bytes + self.up_bytes

    @property
    def nbytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes

    @cached_property
    def fmt(self) -> ExpertFormat:
        """What the fused kernels read (Q4_0 split, Q6_K split or as blocks, the rest as
        blocks)."""
        return ExpertFormat(*self.qtypes, q6_k_split=self.q6_k_split)

    def spans(self) -> tuple[tuple[int, int, int, int], ...]:
        """(start, end, rows, cols) of gate, up and down inside a blob."""
        f, h = self.ffn, self.hidden
        return (
            (0, self.up_offset, f, h),
            (self.up_offset, self.down_offset, f, h),
            (self.down_offset, self.nbytes, h, f),
        )

    def is_split(self, qtype: QType) -> bool:
        """Whether projections of `qtype` are held in a split layout, not as GGUF blocks."""
        return (self.split and qtype in SPLIT_QTYPES) or (
            self.q6_k_split and qtype == QType.Q6_K
        )

    def held(self, qtype: QType, blocks: torch.Tensor) -> torch.Tensor:
        """A projection's GGUF blocks [rows, row bytes] as the blob holds them (flat)."""
        if not self.is_split(qtype):
            return blocks.reshape(-1)
        return {QType.Q4_0: split_q4_0, QType.MXFP4: split_mxfp4}.get(qtype, split_q6_k)(blocks)

    def blocks(self, qtype: QType, part: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The GGUF blocks [..., rows, row bytes] of a projection held as `part` [..., bytes]
        (one per leading index; a copy where it is held split)."""
        if not self.is_split(qtype):
            return part.reshape(*part.shape[:-1], rows, -1)
        unsplit = {QType.Q4_0: unsplit_q4_0, QType.MXFP4: unsplit_mxfp4}.get(qtype, unsplit_q6_k)
        return unsplit(part, rows, cols)

    def views(self, blob: torch.Tensor) -> tuple[QTensor, QTensor, QTensor]:
        """The (gate, up, down) weights inside a blob [>= nbytes] (any device), as GGUF
        blocks (copies where the blob holds a split layout)."""
        out = []
        for (lo, hi, rows, cols), qtype in zip(self.spans(), self.qtypes, strict=True):
            data = self.blocks(qtype, blob[lo:hi], rows, cols)
            out.append(QTensor(data, qtype, (rows, cols)))
        return out[0], out[1], out[2]


@dataclass(frozen=True)
class ExpertLayouts:
    """Every layer's blob layout (a Q4_K_M file's down projections change type from layer to
    layer). The RAM copies take each layer's own size (page-rounded, as the store's plan
    counts them); the VRAM slots, staging and bounce rows, which any layer's blob may fill,
    the largest (`slot_bytes`, 16-byte rounded so the kernels may load 16 at a time)."""

    layers: tuple[BlobLayout, ...]

    def __getitem__(self, layer: int) -> BlobLayout:
        return self.layers[layer]

    @cached_property  # read on every decode step's fetch
    def slot_bytes(self) -> int:
        return max(self.copy_bytes(layer) for layer in range(len(self.layers)))

    def copy_bytes(self, layer: int) -> int:
        """What moving one of the layer's blobs copies: its bytes, rounded up to 16 (the copy
        kernels move 16 bytes at a time; every tier's row holds at least this)."""
        return -(-self.layers[layer].nbytes // 16) * 16

    @property
    def mean_nbytes(self) -> float:
        """The bytes a routed expert moves, on average over the layers."""
        return sum(lay.nbytes for lay in self.layers) / len(self.layers)

    @property
    def hidden(self) -> int:
        return self.layers[0].hidden

    @property
    def ffn(self) -> int:
        return self.layers[0].ffn

    @property
    def offsets_aligned(self) -> bool:
        """Whether every projection starts on 16 bytes within its blob (so, in a blob on 16
        bytes, on 16 bytes too: the kernels may load 16 at a time)."""
        return all(lay.up_offset % 16 == 0 and lay.down_offset % 16 == 0 for lay in self.layers)

    def offsets(self) -> torch.Tensor:
        """[L, 3] int64: each layer's (gate, up, down) byte offsets inside its blobs."""
        return torch.tensor([[0, lay.up_offset, lay.down_offset] for lay in self.layers])

    def qtypes(self) -> list[QType]:
        """The types the experts hold, by name."""
        return sorted({q for lay in self.layers for q in lay.qtypes}, key=lambda q: q.name)


def moe_layers(model: Model) -> list[MoEWeights]:
    """The routed layers' weights, in order (the store's grid: leading dense layers are not
    in it)."""
    arch = ARCHS[model.spec.arch]
    layers = [arch.layer(model, i).mlp for i in model.spec.moe_layers]
    if not layers or not all(isinstance(m, MoEWeights) for m in layers):
        raise ModelError(f"{model.source}: not a mixture-of-experts model")
    return layers  # type: ignore[return-value]


def blob_layouts(model: Model) -> ExpertLayouts:
    """The experts' layouts as the model stores them (GGUF blocks)."""
    out = []
    for mlp in moe_layers(model):
        one = mlp.experts.expert(0)
        out.append(
            BlobLayout(
                qtypes=(one.gate.qtype, one.up.qtype, one.down.qtype),
                hidden=model.spec.hidden,
                ffn=model.spec.expert_ffn,
                gate_bytes=one.gate.nbytes,
                up_bytes=one.up.nbytes,
                down_bytes=one.down.nbytes,
            )
        )
    return ExpertLayouts(tuple(out))


def fast_path_refusal(model: Model) -> str | None:
    """Why the fused kernels cannot read this model's experts (None: they can)."""
    if not model.spec.is_moe:
        return "not a mixture-of-experts model"
    first = model.spec.dense_layers
    for row, lay in enumerate(blob_layouts(model).layers):
        for (_, _, rows, cols), qtype in zip(lay.spans(), lay.qtypes, strict=True):
            if qtype not in MOE_QTYPES:
                return f"layer {first + row} holds {qtype.name} experts"
            if qtype == QType.Q4_0 and not split_q4_0_ok(rows, cols):
                return f"Q4_0 experts of {rows} x {cols} (the kernels read aligned words)"
            if qtype == QType.MXFP4 and not split_mxfp4_ok(rows, cols):
                return f"MXFP4 experts of {rows} x {cols} (the kernels read aligned words)"
    return None


def kernel_layouts(model: Model, q6_k_split: bool = False) -> ExpertLayouts:
    """The blob layouts the fast engine's kernels read: Q4_0 and MXFP4 projections in their
    split layouts, Q6_K ones too with `q6_k_split` (its int8 dots read them in 16-byte words:
    the tuning table's switch `q6_k_layout`), the other types as GGUF blocks."""
    why = fast_path_refusal(model)
    if why is not None:
        raise ModelError(f"{model.source}: the offload engine cannot read it: {why}")
    return ExpertLayouts(tuple(
        replace(lay, split=True, q6_k_split=q6_k_split and QType.Q6_K in lay.qtypes)
        for lay in blob_layouts(model).layers))  # fmt: skip


def from_stored(
    raw: torch.Tensor, stored: ExpertLayout, out: torch.Tensor, layout: BlobLayout
) -> None:
    """Write into out [>= nbytes] the kernels' blob of an expert read in the store's layout
    (raw: its bytes as `stratactl pack` writes them, e.g. read from experts.bin)."""
    parts = zip(layout.spans(), stored.projections, layout.qtypes, strict=True)
    for (start, end, _, _), t, qtype in parts:
        data = raw[t.offset : t.offset + t.nbytes].view(t.shape[0], -1)
        out[start:end].copy_(layout.held(qtype, data))


def dequant_blobs(
    blobs: torch.Tensor, layout: BlobLayout, projection: int, dtype: torch.dtype
) -> torch.Tensor:
    """One projection (0 gate, 1 up, 2 down) of n blobs [n, >= nbytes] as [n, rows, cols] in
    `dtype`, in torch (any device; bit-exact with the GGUF dequantization)."""
    lo, hi, rows, cols = layout.spans()[projection]
    qtype = layout.qtypes[projection]
    part = blobs[:, lo:hi]
    if layout.is_split(qtype) and qtype == QType.Q4_0:
        return dequant_split(part, rows, cols).to(dtype)
    blocks = layout.blocks(qtype, part, rows, cols).reshape(part.shape[0], -1)
    return dequantize(blocks.contiguous(), qtype, (part.shape[0], rows, cols)).to(dtype)


def dequant_split(sections: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Float32 [n, rows, cols] from n split-Q4_0 matrices [n, bytes] (bit-exact with the
    GGUF dequantization of the same blocks: d * (q - 8))."""
    n, nb = sections.shape[0], cols // 32
    scales = sections[:, : rows * nb * 2].contiguous().view(torch.float16).view(n, rows, nb)
    nib = sections[:, rows * nb * 2 :].reshape(n, rows, nb, 16).to(torch.int16)
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1) - 8  # [n, rows, nb, 32]
    return (scales.float()[..., None] * q.float()).view(n, rows, cols)
