"""Routed experts as blobs: one contiguous [gate | up | down] block run per (layer, expert).

This is the unit every tier holds: a VRAM slot, the resident RAM copy and the pack file all
store the same bytes, so moving an expert is one copy and a kernel finds its three
matrices at fixed offsets from one address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe import split_q4_0, unsplit_q4_0
from kernels.quant import QTensor, QType
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelError
from stratad.model.weights import MoEWeights


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


def copy_expert(
    model_layers: list[MoEWeights], layer: int, expert: int, out: torch.Tensor, layout: BlobLayout
) -> None:
    """Write one expert's blob into `out` [nbytes] (from the mapped model file)."""
    w = model_layers[layer].experts.expert(expert)

    def raw(t: QTensor) -> torch.Tensor:
        return split_q4_0(t.data) if layout.split else t.data.reshape(-1).view(torch.uint8)

    out[: layout.gate_bytes].copy_(raw(w.gate))
    out[layout.up_offset : layout.down_offset].copy_(raw(w.up))
    out[layout.down_offset :].copy_(raw(w.down))


def dequant_split(sections: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Float32 [n, rows, cols] from n split-Q4_0 matrices [n, bytes] (bit-exact with the
    GGUF dequantization of the same blocks: d * (q - 8))."""
    n, nb = sections.shape[0], cols // 32
    scales = sections[:, : rows * nb * 2].contiguous().view(torch.float16).view(n, rows, nb)
    nib = sections[:, rows * nb * 2 :].reshape(n, rows, nb, 16).to(torch.int16)
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1) - 8  # [n, rows, nb, 32]
    return (scales.float()[..., None] * q.float()).view(n, rows, cols)
