"""The gated delta rule's torch reference (`kernels.layers.delta_rule` has the rule and its
Triton kernel), token by token in float32. Kept apart from the kernel's module so that the
engines that run without Triton (the cpu engine's reference layers) import it."""

from __future__ import annotations

import torch
import torch.nn.functional as fn

L2_EPS = 1e-6  # q and k: x / sqrt(sum(x^2) + eps), as the reference implementations norm them


def _gates(
    ba: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, k_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, g) [T, Hv] float32 of ba [T, 2 Hv] (per key head: its value heads' b, then their
    alphas)."""
    t, hv = ba.shape[0], ba.shape[1] // 2
    per = ba.float().view(t, k_heads, 2 * (hv // k_heads))
    r = per.shape[-1] // 2
    beta = per[..., :r].reshape(t, hv).sigmoid()
    g = a.float() * fn.softplus(per[..., r:].reshape(t, hv) + dt_bias.float())
    return beta, g


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ba: torch.Tensor,
    dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k [T, Hk, Dk] and v [T, Hv, Dv] as the convolution leaves them, ba [T, 2 Hv],
    dt_bias and a [Hv], state [Hv, Dk, Dv] float32: (out [T, Hv, Dv] float32, the state after
    the last token, a new tensor)."""
    t, hk, dk = q.shape
    hv = v.shape[1]
    r = hv // hk

    def l2norm(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)).repeat_interleave(r, 1)

    q, k = l2norm(q) * dk**-0.5, l2norm(k)
    beta, g = _gates(ba, dt_bias, a, hk)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    v = v.float()
    for i in range(t):
        state = state * g[i].exp()[:, None, None]
        remembered = (state * k[i][:, :, None]).sum(-2)  # [Hv, Dv]
        delta = (v[i] - remembered) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i] = (state * q[i][:, :, None]).sum(-2)
    return out, state
