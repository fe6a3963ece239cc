"""Routed experts as blobs: one contiguous [gate | up | down] block run per (layer, expert).

This is the unit every tier holds: a VRAM slot, the resident RAM copy and the pack file all
store the same bytes, so moving an expert is one copy and a kernel finds its three
matrices at fixed offsets from one address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        """The (gate, up, down) weights inside a blob [nbytes] (any device)."""
        f, h = self.ffn, self.hidden
        g = blob[: self.gate_bytes].view(f, -1)
        u = blob[self.up_offset : self.down_offset].view(f, -1)
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
    out[: layout.gate_bytes].copy_(w.gate.data.reshape(-1).view(torch.uint8))
    out[layout.up_offset : layout.down_offset].copy_(w.up.data.reshape(-1).view(torch.uint8))
    out[layout.down_offset :].copy_(w.down.data.reshape(-1).view(torch.uint8))
