"""Gated DeltaNet linear attention in torch (`stratad.model.graph.deltanet`): the reference for one
sequence's new tokens, continuing its recurrent state token by token, in float32 (the rule
itself: `kernels.layers.delta_rule_ref`)."""

from __future__ import annotations

import torch
import torch.nn.functional as fn

from kernels.layers.delta_rule_ref import gated_delta_rule_ref
from stratad.engine.recurrent import RecurrentState
from stratad.model.graph.deltanet import GatedDeltaNet


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, held: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu of the depthwise causal convolution of x [T, C] (weight [C, K]) after the K - 1
    inputs `held` [C, K - 1] (None: zeros, a sequence's start): (out [T, C], the last K - 1
    inputs to hold)."""
    c, k = weight.shape
    before = held if held is not None else x.new_zeros(c, k - 1)
    seq = torch.cat([before.T, x], dim=0)  # [K - 1 + T, C]
    out = fn.conv1d(seq.T[None], weight[:, None], groups=c)[0].T.contiguous()  # [T, C]
    return fn.silu(out), seq[seq.shape[0] - (k - 1) :].T.contiguous()


def deltanet(
    net: GatedDeltaNet,
    layer: int,
    mixed: torch.Tensor,
    z: torch.Tensor,
    ba: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    eps: float,
    held: RecurrentState,
) -> torch.Tensor:
    """The layer's output before its projection back, [T, value_dim], for the projections of
    its new tokens: mixed [T, conv_dim] (q, k, v), z [T, value_dim], ba [T, 2 Hv]; weights
    (conv [C, K], dt_bias [Hv], a [Hv], norm [Dv]). Continues, and updates, `held`."""
    conv_w, dt_bias, a, norm = (w.float() for w in weights)
    t = mixed.shape[0]
    out, held.conv[layer] = causal_conv(mixed.float(), conv_w, held.conv.get(layer))
    q, k, v = out.split([net.key_dim, net.key_dim, net.value_dim], dim=-1)
    state = held.state.get(layer)
    if state is None:
        state = mixed.new_zeros(net.v_heads, net.k_dim, net.v_dim, dtype=torch.float32)
    o, held.state[layer] = gated_delta_rule_ref(
        q.reshape(t, net.k_heads, net.k_dim), k.reshape(t, net.k_heads, net.k_dim),
        v.reshape(t, net.v_heads, net.v_dim), ba, dt_bias, a, state,
    )  # fmt: skip
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm
    o = o * fn.silu(z.float().view(t, net.v_heads, net.v_dim))
    return o.reshape(t, net.value_dim).to(mixed.dtype)
