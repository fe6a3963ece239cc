"""Torch reference layers: the definition every fast path is checked against."""

from __future__ import annotations

import torch

from stratad.model.graph.routing import SOFTMAX
from stratad.model.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def rope_tables(
    spec: ModelSpec, positions: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, R/2] for the given positions, R the dims RoPE turns (`rotary_dim`), as
    the spec's `rope_scaling` stretches them."""
    inv, scale = spec.rope_scaling.frequencies(spec.rotary_dim, spec.rope_theta)
    ang = positions.to(device=device, dtype=torch.float64)[:, None] * inv.to(device)[None, :]
    if scale == 1.0:
        return ang.cos().float(), ang.sin().float()
    return (ang.cos() * scale).float(), (ang.sin() * scale).float()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate x [T, H, D]: pairs (2i, 2i+1) if interleaved, else halves (i, i + R/2) of its
    first R = 2 * cos.shape[-1] dims (the rest pass through: partial RoPE)."""
    r = 2 * cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin, interleaved), x[..., r:]), dim=-1)
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(x.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal GQA attention of queries at positions start.. over keys 0..start+T-1.

    q [T, Hq, D], k/v [S, Hkv, D] with S = start + T  ->  [T, Hq, D]. `sinks` [Hq]: a logit
    per head that joins each softmax and weighs nothing (gpt-oss); `window`: each query sees
    only itself and the window - 1 keys before it (0: all of them).
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    rep = hq // hkv
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1).float()  # [Hq, S, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1).float()
    qq = q.transpose(0, 1).float()  # [Hq, T, D]
    scores = qq @ kk.transpose(1, 2) / (d**0.5)  # [Hq, T, S]
    qpos = torch.arange(start, start + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    hidden = (kpos > qpos) | (kpos <= qpos - window) if window else kpos > qpos
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        out = scores.softmax(-1) @ vv  # [Hq, T, D]
    else:  # the sink's column joins the softmax, then is dropped
        sink = sinks.float()[:, None, None].expand(hq, t, 1)
        out = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1] @ vv
    return out.transpose(0, 1).to(q.dtype)


def attention_by_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`attention` one query at a time, each exactly as a decode step computes it: a token's
    result does not depend on how its prompt was split into chunks (the cpu engine rounds
    activations to 8 bits, which turns the last-bit differences of a batched product into
    different tokens)."""
    rows = [attention(q[i : i + 1], k[: start + i + 1], v[: start + i + 1], start + i,
                      sinks, window) for i in range(q.shape[0])]  # fmt: skip
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate x) * up x) with float weights [F, H], [F, H], [H, F]."""
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, k] float32, expert ids [T, k])."""
    weights, ids = SOFTMAX.choose(logits, None, top_k)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def route_as(
    spec: ModelSpec, logits: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's routing (`spec.routing`, its correction `bias` [E] where it has one),
    renormalised and scaled as the spec says: (weights [T, k] float32, expert ids [T, k])."""
    weights, ids = spec.routing.choose(logits, bias, spec.n_experts_used)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * spec.expert_scale, ids
