"""Gated DeltaNet linear attention in torch (`stratad.model.graph.deltanet`): the reference for one
sequence's new tokens, continuing its recurrent state token by token, in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as fn

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
    out = (seq.unfold(0, k, 1) * weight).sum(-1)  # windows [T, C, K]
    return fn.silu(out), seq[seq.shape[0] - (k - 1) :].T.contiguous()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k [T, Hv, Dk] (normed, q scaled), v [T, Hv, Dv], decay g and beta [T, Hv], state
    [Hv, Dk, Dv]: (out [T, Hv, Dv], the state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        remembered = (state * k[t][:, :, None]).sum(-2)  # [Hv, Dv]
        delta = (v[t] - remembered) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(-2)
    return out, state


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
    t, r = mixed.shape[0], net.v_heads // net.k_heads
    out, held.conv[layer] = causal_conv(mixed.float(), conv_w, held.conv.get(layer))
    q, k, v = out.split([net.key_dim, net.key_dim, net.value_dim], dim=-1)
    q = _l2norm(q.view(t, net.k_heads, net.k_dim)).repeat_interleave(r, 1) * net.k_dim**-0.5
    k = _l2norm(k.view(t, net.k_heads, net.k_dim)).repeat_interleave(r, 1)
    per = ba.float().view(t, net.k_heads, 2 * r)  # per key head: its value heads' b, then a
    beta = per[..., :r].reshape(t, net.v_heads).sigmoid()
    g = a * fn.softplus(per[..., r:].reshape(t, net.v_heads) + dt_bias)
    state = held.state.get(layer)
    if state is None:
        state = mixed.new_zeros(net.v_heads, net.k_dim, net.v_dim, dtype=torch.float32)
    o, held.state[layer] = gated_delta_rule(q, k, v.view(t, net.v_heads, net.v_dim), g, beta,
                                            state)  # fmt: skip
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm
    o = o * fn.silu(z.float().view(t, net.v_heads, net.v_dim))
    return o.reshape(t, net.value_dim).to(mixed.dtype)
