"""The gated delta rule (Qwen3-Next's Gated DeltaNet, `stratad.model.graph.deltanet`) over one
sequence's new tokens, continuing its recurrent state: for every token t and value head h

    S = S * exp(g);   S = S + k (beta (v - S^T k))^T;   o = S^T q

where q and k are the head's key head's, L2-normed (q also scaled by 1 / sqrt(Dk)), beta =
sigmoid(b) and g = a * softplus(alpha + dt_bias), b and alpha read from the projection `ba`
(per key head: its r value heads' b, then their alphas).

The kernel takes the raw projections as the convolution leaves them: one program per value
head and block of value dims holds its [Dk, BLOCK_V] slice of the state in registers over the
tokens (the state is read and written once per launch), normalising q and k and computing the
gates on the way; no repeated, normed or gated copy of the inputs is made. Tokens run in order
inside a program (a decode step is one; a prefill chunk loops), heads and value blocks in
parallel.

Three tiers: `_delta_rule_kernel` (Triton), `gated_delta_rule()` (launcher) and the torch
reference `gated_delta_rule_ref()`, token by token in float32 (in `delta_rule_ref`, which
imports no Triton: the cpu engine's reference layers run without it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.layers.delta_rule_ref import L2_EPS, gated_delta_rule_ref

__all__ = ["DeltaRuleConfig", "gated_delta_rule", "gated_delta_rule_ref"]


@dataclass(frozen=True)
class DeltaRuleConfig:
    """Launch settings: each program holds a [Dk, block_v] float32 slice of the state."""

    block_v: int = 32
    num_warps: int = 4


@triton.jit
def _delta_rule_kernel(
    q_ptr,  # [T, Hk, DK], rows `stride_qk` apart (q and k are views of one buffer)
    k_ptr,
    v_ptr,  # [T, Hv, DV], rows `stride_v` apart
    ba_ptr,  # [T, Hk, 2R], rows `stride_ba` apart
    dt_bias_ptr,  # [Hv]
    a_ptr,  # [Hv]
    state_ptr,  # [Hv, DK, DV] float32, read and written in place
    out_ptr,  # [T, Hv, DV] float32
    T,
    DV,
    stride_qk,
    stride_v,
    stride_ba,
    scale,
    eps,
    R: tl.constexpr,
    DK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    h = tl.program_id(0)  # the value head
    hk, j = h // R, h % R  # its key head, and its place among the key head's value heads
    n_heads = tl.num_programs(0)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ks < DK, vs < DV
    s_ptrs = state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    rate = tl.load(a_ptr + h).to(tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + t * stride_qk + hk * DK + ks, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_qk + hk * DK + ks, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_v + h * DV + vs, mask=mv, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        row = ba_ptr + t * stride_ba + hk * 2 * R
        beta = tl.sigmoid(tl.load(row + j).to(tl.float32))
        x = tl.load(row + R + j).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        s = s * tl.exp(rate * softplus)
        remembered = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
        delta = (v - remembered) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (t * n_heads + h) * DV + vs, o, mask=mv)
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ba: torch.Tensor,
    dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor,
    config: DeltaRuleConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """`gated_delta_rule_ref`'s product in one launch: out [T, Hv, Dv] float32; `state` [Hv,
    Dk, Dv] (float32, contiguous) is updated in place. q and k are [T, Hk, Dk] views sharing
    their row stride (the convolution's output), v [T, Hv, Dv] and ba [T, 2 Hv] with unit
    stride inside a row."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or k.stride() != q.stride() or hv % hk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} for {hv} value heads")
    if state.shape != (hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state {tuple(state.shape)} {state.dtype}: not [{hv}, {dk}, {dv}]"
                         " contiguous float32")  # fmt: skip
    if ba.shape != (t, 2 * hv) or dt_bias.shape != (hv,) or a.shape != (hv,):
        raise ValueError(f"ba {tuple(ba.shape)}, dt_bias {tuple(dt_bias.shape)}, a"
                         f" {tuple(a.shape)} for {t} tokens of {hv} value heads")  # fmt: skip
    if q.stride(1) != dk or q.stride(2) != 1 or v.stride(1) != dv or v.stride(2) != 1 or (
        ba.stride(1) != 1
    ):
        raise ValueError("q, k, v and ba: heads packed inside each row")
    cfg = config or DeltaRuleConfig()
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=v.device)
    if t:
        block_v = min(cfg.block_v, triton.next_power_of_2(dv))
        _delta_rule_kernel[(hv, triton.cdiv(dv, block_v))](
            q, k, v, ba, dt_bias.contiguous(), a.contiguous(), state, out, t, dv,
            q.stride(0), v.stride(0), ba.stride(0), dk**-0.5, L2_EPS,
            R=hv // hk, DK=dk, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return out
