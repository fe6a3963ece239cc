"""Routed experts as blobs: one contiguous [gate | up | down] block run per (layer, expert).

This is the unit every tier holds: a VRAM slot, the resident RAM copy and the pack file all
store the same bytes, so moving an expert is one copy and a kernel finds its three
matrices at fixed offsets from one address.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.moe import split_q4_0, split_q4_0_ok, unsplit_q4_0
from kernels.quant import QTensor, QType
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelError
from stratad.model.weights import MoEWeights
from stratad.store.manifest import ExpertLayout


@dataclass(frozen=True)
class BlobLayout:
    """Byte offsets of the three matrices inside one expert blob."""

    qtype: QType
    hidden: int
    ffn: int
    gate_bytes: int  # [F, H] blocks
    down_bytes: int  # [H, F] blocks
    split: bool = False  # Q4_0 in the kernels' split layout (kernels.moe.split_q4_0)

    @property
    def up_offset(self) -> int:
        return self.gate_bytes

    @property
    def down_offset(self) -> int:
        return 2 * self.gate_bytes

    @property
    def nbytes(self) -> int:
        return 2 * self.gate_bytes + self.down_bytes

    def views(self, blob: torch.Tensor) -> tuple[QTensor, QTensor, QTensor]:
        """The (gate, up, down) weights inside a blob [nbytes] (any device), as GGUF blocks
        (copies when the blob holds the split layout)."""
        f, h = self.ffn, self.hidden
        parts = blob[: self.gate_bytes], blob[self.up_offset : self.down_offset]
        if self.split:
            g, u = (unsplit_q4_0(p, f, h) for p in parts)
            d = unsplit_q4_0(blob[self.down_offset :], h, f)
        else:
            g, u = (p.view(f, -1) for p in parts)
            d = blob[self.down_offset :].view(h, -1)
        return (
            QTensor(g, self.qtype, (f, h)),
            QTensor(u, self.qtype, (f, h)),
            QTensor(d, self.qtype, (h, f)),
        )


def moe_layers(model: Model) -> list[MoEWeights]:
    arch = ARCHS[model.spec.arch]
    layers = [arch.layer(model, i).mlp for i in range(model.spec.n_layers)]
    if not all(isinstance(m, MoEWeights) for m in layers):
        raise ModelError(f"{model.source}: not a mixture-of-experts model")
    return layers  # type: ignore[return-value]


def blob_layout(model: Model) -> BlobLayout:
    stack = moe_layers(model)[0].experts
    qtypes = {stack.gate.qtype, stack.up.qtype, stack.down.qtype}
    if len(qtypes) != 1:
        raise ModelError(
            f"{model.source}: experts mix tensor types {sorted(q.name for q in qtypes)}"
        )
    qtype = qtypes.pop()
    one = stack.expert(0)
    return BlobLayout(
        qtype=qtype,
        hidden=model.spec.hidden,
        ffn=model.spec.expert_ffn,
        gate_bytes=one.gate.nbytes,
        down_bytes=one.down.nbytes,
    )


def kernel_layout(model: Model) -> BlobLayout:
    """The blob layout the fast engine's kernels read: Q4_0 in the split layout."""
    layout = blob_layout(model)
    spec = model.spec
    shapes = ((spec.expert_ffn, spec.hidden), (spec.hidden, spec.expert_ffn))
    if layout.qtype != QType.Q4_0 or not all(split_q4_0_ok(r, c) for r, c in shapes):
        raise ModelError(
            f"{model.source}: the offload engine reads Q4_0 experts, not {layout.qtype.name}"
        )
    return replace(layout, split=True)


def from_stored(
    raw: torch.Tensor, stored: ExpertLayout, out: torch.Tensor, layout: BlobLayout
) -> None:
    """Write into out [nbytes] the kernels' blob of an expert read in the store's layout
    (raw: its bytes as `stratactl pack` writes them, e.g. read from experts.bin)."""
    ends = (layout.up_offset, layout.down_offset, layout.nbytes)
    for start, end, t in zip((0, *ends[:2]), ends, stored.projections, strict=True):
        data = raw[t.offset : t.offset + t.nbytes].view(t.shape[0], -1)
        out[start:end].copy_(split_q4_0(data) if layout.split else data.reshape(-1))


def dequant_split(sections: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Float32 [n, rows, cols] from n split-Q4_0 matrices [n, bytes] (bit-exact with the
    GGUF dequantization of the same blocks: d * (q - 8))."""
    n, nb = sections.shape[0], cols // 32
    scales = sections[:, : rows * nb * 2].contiguous().view(torch.float16).view(n, rows, nb)
    nib = sections[:, rows * nb * 2 :].reshape(n, rows, nb, 16).to(torch.int16)
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1) - 8  # [n, rows, nb, 32]
    return (scales.float()[..., None] * q.float()).view(n, rows, cols)
