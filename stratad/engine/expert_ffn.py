"""What a model's experts compute beyond their three products, for the compiled CPU kernels
(`kernels.cpu.experts.ExpertExtras`): gpt-oss's per-expert biases and clamped SwiGLU. The cpu
engine's one-call routed experts and the offload engine's CPU share of the misses both hand
it to the kernels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kernels.cpu.experts import PLAIN, ExpertExtras
from stratad.model.graph.activation import SILU, Activation, ClampedSwiGlu
from stratad.model.weights import MoEWeights

Biases = tuple[torch.Tensor, torch.Tensor]  # every expert's gate and up [E, 2, F], down [E, H]


@dataclass(frozen=True)
class ExpertFfn:
    """By routed layer (the store's row), every expert's biases on the host (float32; a layer
    missing: none), and the activation of gate and up."""

    biases: Mapping[int, Biases] = field(default_factory=dict)
    activation: Activation = SILU

    def extras(self, layer: int, experts: Sequence[int] | torch.Tensor) -> ExpertExtras:
        """The kernels' extras for items of `experts` (one per item) of routed layer `layer`."""
        bias = self.biases.get(layer)
        act = self.activation
        clamp = (act.alpha, act.limit) if isinstance(act, ClampedSwiGlu) else None
        if bias is None:
            return PLAIN if clamp is None else ExpertExtras(clamp=clamp)
        at = torch.as_tensor(experts, dtype=torch.long).reshape(-1)
        return ExpertExtras(bias[0].index_select(0, at), bias[1].index_select(0, at), clamp)


def host_biases(moe: MoEWeights) -> Biases | None:
    """A MoE layer's expert biases as `ExpertFfn` holds them (None: it has none)."""
    ex = moe.experts
    if ex.gate_bias is None or ex.up_bias is None or ex.down_bias is None:
        return None
    gate, up, down = (t.dequantize().float() for t in (ex.gate_bias, ex.up_bias, ex.down_bias))
    return torch.stack([gate, up], dim=1).contiguous(), down.contiguous()


PLAIN_FFN = ExpertFfn()  # SiLU experts without biases
