"""The dense (non-expert) weights of MoE layers, dequantized once into the compute dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.formats.quant import QTensor
from stratad.model.archs import ARCHS
from stratad.model.spec import Model, ModelError
from stratad.model.weights import MoEWeights


@dataclass
class DenseLayer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [q_dim + 2 kv_dim, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ffn_norm: torch.Tensor
    router: torch.Tensor  # [E, H]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    shared_gate: torch.Tensor | None


def dense_layers(
    model: Model, device: torch.device, dtype: torch.dtype, layers: range
) -> dict[int, DenseLayer]:
    """Everything but the routed experts of these layers, dequantized once into the compute
    dtype."""

    def f(t: QTensor) -> torch.Tensor:
        return t.dequantize().to(device=device, dtype=dtype)

    def opt(t: QTensor | None) -> torch.Tensor | None:
        return None if t is None else f(t)

    arch = ARCHS[model.spec.arch]
    out = {}
    for i in layers:
        w = arch.layer(model, i)
        moe, a = w.mlp, w.attn
        if not isinstance(moe, MoEWeights):
            raise ModelError(f"{model.source}: layer {i} has no routed experts")
        biases = (a.q_bias, a.k_bias, a.v_bias)
        bias = torch.cat([f(b) for b in biases if b is not None]) if a.q_bias is not None else None
        shared = moe.shared
        out[i] = DenseLayer(
            attn_norm=f(w.attn_norm),
            qkv=torch.cat([f(a.q), f(a.k), f(a.v)]),
            qkv_bias=bias,
            q_norm=opt(a.q_norm),
            k_norm=opt(a.k_norm),
            o=f(a.o),
            ffn_norm=f(w.ffn_norm),
            router=f(moe.router),
            shared=(f(shared.gate), f(shared.up), f(shared.down)) if shared else None,
            shared_gate=opt(moe.shared_gate),
        )
    return out
