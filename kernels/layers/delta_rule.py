"""The gated delta rule (Qwen3-Next's Gated DeltaNet, `stratad.model.graph.deltanet`) over one
sequence's new tokens, continuing its recurrent state: for every token t and value head h

    S = S * exp(g);   S = S + k (beta (v - S^T k))^T;   o = S^T q

where q and k are the head's key head's, L2-normed (q also scaled by 1 / sqrt(Dk)), beta =
sigmoid(b) and g = a * softplus(alpha + dt_bias), b and alpha read from the projection `ba`
(per key head: its r value heads' b, then their alphas).

The kernels take the raw projections as the convolution leaves them: one program per value
head and block of value dims holds its [Dk, BLOCK_V] slice of the state in registers over the
tokens (the state is read and written once per launch), normalising q and k and computing the
gates on the way; no repeated, normed or gated copy of the inputs is made. Heads and value
blocks run in parallel. Two forms of the same rule:
- `_delta_rule_kernel`, token by token: a decode step (one token) or a short span; with ROWS,
  a decode step of B sequences in one launch, row b's state at the address a table holds
  (`gated_delta_rule_rows`).
- the chunked form, C tokens at a time in matrix products (as in Yang et al.'s DeltaNet and
  Gated DeltaNet papers): with G the cumulative log decay in the chunk, gamma = exp(G),
  Gam[t, i] = exp(G_t - G_i) for i <= t and S0 the state before the chunk, the deltas
  d_t = beta_t (v_t - gamma_t S0^T k_t - sum_{i<t} Gam[t, i] (k_t . k_i) d_i) solve
  (I + A) D = beta (V - gamma K S0), A = beta Gam (K K^T) strictly below the diagonal; then
  O = gamma Q S0 + (Gam (Q K^T)) D and S = gamma_C S0 + (K exp(G_C - G))^T D. (I + A)^-1
  depends on the keys and gates alone: `_delta_rule_solve_kernel` finds it for every chunk
  and head at once (forward substitution, a row at a time: a power series of A, shorter in
  steps, loses every digit where a chunk repeats a key), and `_delta_rule_chunk_kernel` runs
  the chunks in order, six products each.
The launcher takes the chunked form for spans of at least `DeltaRuleConfig.chunk_from` tokens.

Three tiers: the Triton kernels, `gated_delta_rule()` (launcher) and the torch reference
`gated_delta_rule_ref()`, token by token in float32 (in `delta_rule_ref`, which imports no
Triton: the cpu engine's reference layers run without it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.layers.delta_rule_ref import L2_EPS, gated_delta_rule_ref

__all__ = ["DeltaRuleConfig", "gated_delta_rule", "gated_delta_rule_ref", "gated_delta_rule_rows"]


@dataclass(frozen=True)
class DeltaRuleConfig:
    """Launch settings: each program holds a [Dk, block_v] float32 slice of the state."""

    block_v: int = 32
    num_warps: int = 4
    # the chunked form: spans of at least `chunk_from` tokens, `chunk` tokens (a power of two,
    # at least 16) a step, [Dk, chunk_block_v] of the state per program; its products in
    # float32 ("ieee") or as three TF32 products ("tf32x3", NVIDIA's tensor cores; as close
    # to the token form on an H100, 14x faster than "ieee"); None: tf32x3 on CUDA, else ieee
    chunk_from: int = 64
    chunk: int = 64
    chunk_block_v: int = 64
    chunk_warps: int = 8
    precision: str | None = None


@triton.jit
def _program_slice(state_ptr, dt_bias_ptr, a_ptr, DV, R: tl.constexpr, DK: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """A program's value head h (program 0), its key head hk and place j among that key
    head's value heads, its key and value dims with their masks, its [BK, BV] slice of the
    state (pointers and values) and the head's dt_bias and decay rate a."""
    h = tl.program_id(0)
    hk, j = h // R, h % R
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ks < DK, vs < DV
    s_ptrs = state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    rate = tl.load(a_ptr + h).to(tl.float32)
    return h, hk, j, ks, vs, mk, mv, s_ptrs, s, dt_bias, rate


@triton.jit
def _token_step(q_row, k_row, v_row, ba_row, s, h, hk, j, ks, vs, mk, mv, dt_bias, rate, DV,
                scale, eps, R: tl.constexpr, DK: tl.constexpr):  # fmt: skip
    """One token's step of value head h's state slice s [BLOCK_K, BLOCK_V] from its token's
    rows of q, k, v and ba: (the new slice, its output [BLOCK_V])."""
    q = tl.load(q_row + hk * DK + ks, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_row + hk * DK + ks, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_row + h * DV + vs, mask=mv, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    row = ba_row + hk * 2 * R
    beta = tl.sigmoid(tl.load(row + j).to(tl.float32))
    x = tl.load(row + R + j).to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    s = s * tl.exp(rate * softplus)
    remembered = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
    delta = (v - remembered) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


@triton.jit
def _delta_rule_kernel(
    q_ptr,  # [T, Hk, DK], rows `stride_qk` apart (q and k are views of one buffer)
    k_ptr,
    v_ptr,  # [T, Hv, DV], rows `stride_v` apart
    ba_ptr,  # [T, Hk, 2R], rows `stride_ba` apart
    dt_bias_ptr,  # [Hv]
    a_ptr,  # [Hv]
    state_ptr,  # [Hv, DK, DV] float32, read and written in place; ROWS: [T] int64 addresses
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
    ROWS: tl.constexpr,  # each row one token of its own sequence (program 2), its state's
    # address in the table at state_ptr; else one sequence's T tokens
):
    if ROWS:
        first = tl.program_id(2).to(tl.int64)
        state_ptr = tl.load(state_ptr + first).to(tl.pointer_type(tl.float32))
        end = first + 1
    else:
        first, end = 0, T
    h, hk, j, ks, vs, mk, mv, s_ptrs, s, dt_bias, rate = _program_slice(
        state_ptr, dt_bias_ptr, a_ptr, DV, R, DK, BLOCK_K, BLOCK_V
    )
    n_heads = tl.num_programs(0)
    for t in range(first, end):
        s, o = _token_step(q_ptr + t * stride_qk, k_ptr + t * stride_qk, v_ptr + t * stride_v,
                           ba_ptr + t * stride_ba, s, h, hk, j, ks, vs, mk, mv, dt_bias, rate,
                           DV, scale, eps, R, DK)  # fmt: skip
        tl.store(out_ptr + (t * n_heads + h) * DV + vs, o, mask=mv)
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _chunk_keys_gates(k_ptr, ba_ptr, rows, mt, ks, mk, stride_qk, stride_ba, hk, j, dt_bias,
                      rate, eps, R: tl.constexpr, DK: tl.constexpr):  # fmt: skip
    """A chunk's keys [C, BK] (L2-normed), beta [C], g [C] and its cumulative sum (rows past T:
    zero keys and gates, which leave the state alone)."""
    at = rows[:, None] * stride_qk + hk * DK + ks[None, :]
    k = tl.load(k_ptr + at, mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
    k = k / tl.sqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    row = ba_ptr + rows * stride_ba + hk * 2 * R
    beta = tl.where(mt, tl.sigmoid(tl.load(row + j, mask=mt, other=0.0).to(tl.float32)), 0.0)
    x = tl.load(row + R + j, mask=mt, other=0.0).to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = tl.where(mt, rate * softplus, 0.0)  # log decays (<= 0)
    return k, beta, g, tl.cumsum(g, axis=0)


@triton.jit
def _decays(big_g, ts):
    """Gam [C, C]: exp(G_t - G_i) for i <= t, else 0."""
    upto = ts[:, None] >= ts[None, :]
    return tl.where(upto, tl.exp(tl.where(upto, big_g[:, None] - big_g[None, :], 0.0)), 0.0)


@triton.jit
def _delta_rule_solve_kernel(
    k_ptr,  # as _delta_rule_kernel's
    ba_ptr,
    dt_bias_ptr,
    a_ptr,
    inv_ptr,  # [chunks, Hv, C, C] float32: each chunk's (I + A)^-1
    T,
    stride_qk,
    stride_ba,
    eps,
    R: tl.constexpr,
    DK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (value head, chunk), all in parallel: (I + A)^-1 of the chunk by forward
    substitution, a row after the rows above it (as stable as the token-by-token rule)."""
    h, c = tl.program_id(0), tl.program_id(1)
    hk, j = h // R, h % R
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, C)
    rows = c * C + ts
    k, beta, g, big_g = _chunk_keys_gates(
        k_ptr, ba_ptr, rows, rows < T, ks, ks < DK, stride_qk, stride_ba, hk, j,
        tl.load(dt_bias_ptr + h).to(tl.float32), tl.load(a_ptr + h).to(tl.float32), eps, R, DK,
    )  # fmt: skip
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)  # [C, C]
    below = ts[:, None] > ts[None, :]
    minus_a = tl.where(below, -(beta[:, None] * _decays(big_g, ts) * kk), 0.0)
    eye = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    inv = eye
    for r in range(1, C):
        sel = ts[:, None] == r
        a_row = tl.sum(tl.where(sel, minus_a, 0.0), axis=0)  # -A[r, :], zero from column r on
        inv = tl.where(sel, eye + tl.sum(a_row[:, None] * inv, axis=0)[None, :], inv)
    tl.store(inv_ptr + ((c * tl.num_programs(0) + h) * C + ts[:, None]) * C + ts[None, :], inv)


@triton.jit
def _delta_rule_chunk_kernel(
    q_ptr,  # as _delta_rule_kernel's
    k_ptr,
    v_ptr,
    ba_ptr,
    dt_bias_ptr,
    a_ptr,
    state_ptr,
    out_ptr,
    inv_ptr,  # [chunks, Hv, C, C]: `_delta_rule_solve_kernel`'s
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
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (value head, block of value dims), the chunks in order: the deltas, the
    outputs and the state after each chunk in matrix products."""
    h, hk, j, ks, vs, mk, mv, s_ptrs, s, dt_bias, rate = _program_slice(
        state_ptr, dt_bias_ptr, a_ptr, DV, R, DK, BLOCK_K, BLOCK_V
    )
    n_heads = tl.num_programs(0)
    ts = tl.arange(0, C)
    for c0 in range(0, T, C):
        rows = c0 + ts
        mt = rows < T
        k, beta, g, big_g = _chunk_keys_gates(
            k_ptr, ba_ptr, rows, mt, ks, mk, stride_qk, stride_ba, hk, j, dt_bias, rate, eps, R, DK
        )
        q = tl.load(q_ptr + rows[:, None] * stride_qk + hk * DK + ks[None, :],
                    mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # fmt: skip
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + eps)[:, None] * scale
        m2v = mt[:, None] & mv[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_v + h * DV + vs[None, :], mask=m2v,
                    other=0.0).to(tl.float32)  # fmt: skip
        inv = tl.load(inv_ptr + (((c0 // C) * n_heads + h) * C + ts[:, None]) * C + ts[None, :])
        gamma = tl.exp(big_g)
        u = tl.dot(inv, beta[:, None] * v, input_precision=PRECISION)  # [C, BV]
        w = tl.dot(inv, (beta * gamma)[:, None] * k, input_precision=PRECISION)  # [C, BK]
        d = u - tl.dot(w, s, input_precision=PRECISION)  # the deltas [C, BV]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [C, C]
        o = gamma[:, None] * tl.dot(q, s, input_precision=PRECISION)
        o += tl.dot(_decays(big_g, ts) * qk, d, input_precision=PRECISION)
        tl.store(out_ptr + (rows[:, None] * n_heads + h) * DV + vs[None, :], o, mask=m2v)
        last = tl.sum(g, axis=0)
        kd = k * tl.exp(last - big_g)[:, None]  # [C, BK]
        s = tl.exp(last) * s + tl.dot(tl.trans(kd), d, input_precision=PRECISION)
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])


def _checked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ba: torch.Tensor,
    dt_bias: torch.Tensor, a: torch.Tensor,
) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(T, Hk, Dk, Hv, Dv) of the rule's inputs, which it checks: q and k [T, Hk, Dk] views
    sharing their row stride, v [T, Hv, Dv], ba [T, 2 Hv], heads packed inside each row."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or k.stride() != q.stride() or hv % hk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} for {hv} value heads")
    if ba.shape != (t, 2 * hv) or dt_bias.shape != (hv,) or a.shape != (hv,):
        raise ValueError(f"ba {tuple(ba.shape)}, dt_bias {tuple(dt_bias.shape)}, a"
                         f" {tuple(a.shape)} for {t} tokens of {hv} value heads")  # fmt: skip
    if q.stride(1) != dk or q.stride(2) != 1 or v.stride(1) != dv or v.stride(2) != 1 or (
        ba.stride(1) != 1
    ):
        raise ValueError("q, k, v and ba: heads packed inside each row")
    return t, hk, dk, hv, dv


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ba: torch.Tensor,
    dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor,
    config: DeltaRuleConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """`gated_delta_rule_ref`'s product in one launch: out [T, Hv, Dv] float32; `state` [Hv,
    Dk, Dv] (float32, contiguous) is updated in place. q and k are [T, Hk, Dk] views sharing
    their row stride (the convolution's output), v [T, Hv, Dv] and ba [T, 2 Hv] with unit
    stride inside a row."""
    t, hk, dk, hv, dv = _checked(q, k, v, ba, dt_bias, a)
    if state.shape != (hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state {tuple(state.shape)} {state.dtype}: not [{hv}, {dk}, {dv}]"
                         " contiguous float32")  # fmt: skip
    cfg = config or DeltaRuleConfig()
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=v.device)
    args = (q, k, v, ba, dt_bias.contiguous(), a.contiguous(), state, out, t, dv, q.stride(0),
            v.stride(0), ba.stride(0), dk**-0.5, L2_EPS)  # fmt: skip
    block_k = max(16, triton.next_power_of_2(dk))
    if t >= cfg.chunk_from:
        if cfg.chunk < 16 or cfg.chunk & (cfg.chunk - 1):
            raise ValueError(f"chunk {cfg.chunk}: not a power of two of at least 16")
        chunks, c = triton.cdiv(t, cfg.chunk), cfg.chunk
        inv = torch.empty((chunks, hv, c, c), dtype=torch.float32, device=v.device)
        precision = cfg.precision or ("tf32x3" if torch.version.cuda else "ieee")
        # (one stage: the chunk loop's loads pipelined ask for more shared memory than an
        # H100 has, 384 KiB)
        _delta_rule_solve_kernel[(hv, chunks)](
            k, ba, args[4], args[5], inv, t, q.stride(0), ba.stride(0), L2_EPS, R=hv // hk,
            DK=dk, BLOCK_K=block_k, C=c, PRECISION=precision, num_warps=cfg.num_warps,
            num_stages=1,
        )  # fmt: skip
        block_v = max(16, min(cfg.chunk_block_v, triton.next_power_of_2(dv)))
        _delta_rule_chunk_kernel[(hv, triton.cdiv(dv, block_v))](
            *args[:8], inv, *args[8:], R=hv // hk, DK=dk, BLOCK_K=block_k, BLOCK_V=block_v,
            C=c, PRECISION=precision, num_warps=cfg.chunk_warps, num_stages=1,
        )  # fmt: skip
    elif t:
        block_v = min(cfg.block_v, triton.next_power_of_2(dv))
        _delta_rule_kernel[(hv, triton.cdiv(dv, block_v))](
            *args, R=hv // hk, DK=dk, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
            ROWS=False, num_warps=cfg.num_warps,
        )  # fmt: skip
    return out


def gated_delta_rule_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ba: torch.Tensor,
    dt_bias: torch.Tensor, a: torch.Tensor, states: torch.Tensor,
    config: DeltaRuleConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """A decode step of B sequences in one launch: row b (one token) continues the state at
    address `states[b]` (int64 [B] on the device: a float32 [Hv, Dk, Dv] contiguous tensor's
    `data_ptr()`, each row's its own, updated in place; the caller vouches for them); out
    [B, Hv, Dv] float32, row b `gated_delta_rule` of row b alone. Shapes as there, T = B."""
    b, hk, dk, hv, dv = _checked(q, k, v, ba, dt_bias, a)
    if states.shape != (b,) or states.dtype != torch.int64 or states.device != v.device:
        raise ValueError(f"states: int64 [{b}] on {v.device}, got {states.dtype}"
                         f" {tuple(states.shape)} on {states.device}")  # fmt: skip
    cfg = config or DeltaRuleConfig()
    out = torch.empty((b, hv, dv), dtype=torch.float32, device=v.device)
    if b:
        block_v = min(cfg.block_v, triton.next_power_of_2(dv))
        _delta_rule_kernel[(hv, triton.cdiv(dv, block_v), b)](
            q, k, v, ba, dt_bias.contiguous(), a.contiguous(), states, out, b, dv, q.stride(0),
            v.stride(0), ba.stride(0), dk**-0.5, L2_EPS, R=hv // hk, DK=dk,
            BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, ROWS=True,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return out
