"""Decode attention: one query token per sequence over its KV cache, with GQA.

q [B, Hq, D] attends to the first seq_lens[b] positions of k/v caches [B, S, Hkv, D]
(any strides with a contiguous last dim, so a slot of a larger cache pool is a view).
Query head h reads KV head h // (Hq / Hkv), as Hugging Face's repeat_kv and llama.cpp do.
Scores, softmax and the weighted sum are float32 (online softmax over blocks of S).

One program serves all query heads of one KV head, so each K/V row is read once per
group rather than once per query head: decode attention is bound by reading the cache.

Split-K ("flash-decoding"): a grid of (B, Hkv) alone is a handful of programs, each
walking the whole sequence, so the sequence is cut into P pieces, P = min(cdiv(S, split_s),
max_splits) for a cache of S positions. The pieces share the sequence's *current* length:
each holds cdiv(seq_len, P) positions rounded up to whole steps of block_s, so a short
sequence in a long cache is still spread over the GPU and no program walks empty positions
(a grid sized by S alone would launch hundreds of programs per head that do nothing).
`_decode_attention_split_kernel` runs on (B, Hkv, P) and writes, per (sequence, query
head, piece), the float32 running max m, sum of exp l and unnormalised weighted sum acc [D]
of its positions (a piece past seq_len writes m = -inf, l = 0 and nothing else).
`_decode_attention_reduce_kernel` runs on (B, Hq) and merges the pieces that hold
positions: out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j with M = max_j m_j.
When P is 1, that piece is the whole answer: the first kernel normalises it and writes the
output itself (WHOLE), and there is no second launch. The grids and every host-side value
depend on shapes and the config only, never on the values of seq_lens, so a launch can be
captured in a CUDA graph and replayed as they grow.

Three tiers: the Triton kernels above, `decode_attention()` (launcher), and the torch
reference `decode_attention_ref()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionConfig:
    block_s: int = 64  # cache positions per step (a power of two)
    split_s: int = 512  # a cache of S positions is cut into cdiv(S, split_s) pieces...
    max_splits: int = 64  # ...at most this many per sequence and KV head
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _load_q(
    q_ptr,
    b,
    kv_head,
    stride_qb,
    stride_qh,
    scale,
    mask,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The scaled float32 queries [BG, BD] of KV head `kv_head`'s group (zero where masked)."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    return tl.load(q_at, mask=mask, other=0.0).to(tl.float32) * scale


@triton.jit
def _attend(
    q,  # [BG, BD] float32, scaled
    k_base,  # K/V of one sequence and KV head at position 0
    v_base,
    stride_ks,
    stride_vs,
    start,
    end,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Online softmax of q over positions [start, end): (max m [BG], sum of exp l [BG],
    unnormalised weighted sum acc [BG, BD]); m = -inf, l = 0, acc = 0 when empty."""
    d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BS]
        kv_mask = (s[:, None] < end) & (d[None, :] < D)
        rows = s[:, None].to(tl.int64)
        k = tl.load(k_base + rows * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BG, BS]
        scores = tl.where(s[None, :] < end, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp(scores - m_new[:, None])  # [BG, BS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rows * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _piece(seq_len, N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Positions per piece: the length shared by N_SPLITS pieces, in whole steps."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, N_SPLITS), BLOCK_S), 1) * BLOCK_S


@triton.jit
def _decode_attention_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [B, S, Hkv, D]
    v_ptr,  # [B, S, Hkv, D]
    len_ptr,  # [B]
    m_ptr,  # [B, Hq, n_splits] float32
    l_ptr,  # [B, Hq, n_splits] float32, strides of m
    acc_ptr,  # [B, Hq, n_splits, D] float32
    out_ptr,  # [B, Hq, D]: written directly when WHOLE
    scale,
    S,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_aj,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_SPLITS: tl.constexpr,
    WHOLE: tl.constexpr,  # one piece holds the whole cache: normalise, write out, no reduce
):
    """Program (b, KV head, j) over piece j of sequence b's positions (`_piece`). A piece
    past seq_len reads nothing and writes m = -inf, l = 0 (the reduce kernel does not read
    it)."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    seq_len = tl.minimum(tl.load(len_ptr + b), S)
    piece = _piece(seq_len, N_SPLITS, BLOCK_S)
    start = split * piece
    end = tl.minimum(start + piece, seq_len)
    live = tl.where(start < seq_len, GROUP, 0)  # query heads with positions here
    work_mask = (g[:, None] < live) & (d[None, :] < D)
    q = _load_q(q_ptr, b, kv_head, stride_qb, stride_qh, scale, work_mask, GROUP, BLOCK_G, BLOCK_D)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    m_i, l_i, acc = _attend(
        q, k_base, v_base, stride_ks, stride_vs, start, end, D, BLOCK_G, BLOCK_D, BLOCK_S
    )
    heads = kv_head * GROUP + g
    if WHOLE:
        out_at = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_at, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=work_mask)
        return
    ml_at = b * stride_mb + heads * stride_mh + split
    tl.store(m_ptr + ml_at, m_i, mask=g < GROUP)
    tl.store(l_ptr + ml_at, l_i, mask=g < GROUP)
    acc_at = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + split * stride_aj + d[None, :]
    tl.store(acc_at, acc, mask=work_mask)


@triton.jit
def _decode_attention_reduce_kernel(
    len_ptr,  # [B]
    m_ptr,  # [B, Hq, n_splits] float32
    l_ptr,  # [B, Hq, n_splits] float32, strides of m
    acc_ptr,  # [B, Hq, n_splits, D] float32
    out_ptr,  # [B, Hq, D]
    S,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_aj,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_SPLITS: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Second pass: program (b, query head) merges the pieces of sequence b that hold
    positions, rescaled to their common max, BLOCK_J pieces at a time."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    seq_len = tl.minimum(tl.load(len_ptr + b), S)
    n_live = tl.cdiv(seq_len, _piece(seq_len, N_SPLITS, BLOCK_S))
    ml_base = b * stride_mb + head * stride_mh
    acc_base = acc_ptr + b * stride_ab + head * stride_ah
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j0 in range(0, n_live, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        live = j < n_live  # every live piece has a position: its m is finite
        m_j = tl.load(m_ptr + ml_base + j, mask=live, other=float("-inf"))
        l_j = tl.load(l_ptr + ml_base + j, mask=live, other=0.0)
        acc_at = acc_base + j[:, None].to(tl.int64) * stride_aj + d[None, :]
        acc_j = tl.load(acc_at, mask=live[:, None] & (d[None, :] < D), other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_j, axis=0))
        alpha = tl.exp(m_run - m_new)  # rescales what was merged under the old max
        beta = tl.exp(m_j - m_new)  # [BJ]; 0 for pieces past the length
        l_run = l_run * alpha + tl.sum(l_j * beta, axis=0)
        acc = acc * alpha + tl.sum(acc_j * beta[:, None], axis=0)
        m_run = m_new
    out = acc / l_run
    out_at = out_ptr + b * stride_ob + head * stride_oh + d
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, Hq, D] and k, v [B, S, Hkv, D]; got {tuple(q.shape)}"
            f", {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, Hq, D = q.shape
    _, S, Hkv, _ = k_cache.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{Hq} query heads is not a multiple of {Hkv} KV heads")
    if seq_lens.shape != (B,) or seq_lens.is_floating_point():
        raise ValueError(
            f"seq_lens must be integers [B={B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if not (
        q.is_floating_point() and k_cache.dtype == v_cache.dtype and k_cache.is_floating_point()
    ):
        raise TypeError(
            f"need float q and caches of one float dtype, got {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    if not (q.device == k_cache.device == v_cache.device == seq_lens.device):
        raise ValueError("q, caches and seq_lens must be on one device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(
            "KV caches need a contiguous head dim (copying one per step would "
            "cost more than the attention)"
        )


def _check_config(cfg: AttentionConfig) -> None:
    if cfg.block_s < 1 or cfg.block_s & (cfg.block_s - 1):
        raise ValueError(f"block_s {cfg.block_s} is not a power of two")
    if cfg.split_s < 1 or cfg.split_s % cfg.block_s:
        raise ValueError(f"split_s {cfg.split_s} is not a multiple of block_s {cfg.block_s}")
    if cfg.max_splits < 1:
        raise ValueError(f"max_splits {cfg.max_splits} is not positive")


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    cfg: AttentionConfig,
) -> None:
    B, Hq, D = q.shape
    _, S, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    n_splits = min(triton.cdiv(S, cfg.split_s), cfg.max_splits)
    whole = n_splits == 1
    # Partials of every piece (none when one piece is the whole cache); those past a
    # sequence's length are never read.
    n_part = 0 if whole else n_splits
    m = torch.empty(B, Hq, n_part, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, Hq, n_part, D, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    _decode_attention_split_kernel[(B, Hkv, n_splits)](
        q, k_cache, v_cache, seq_lens, m, l, acc, out, scale, S,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1),
        D=D, GROUP=group, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=block_d, BLOCK_S=cfg.block_s, N_SPLITS=n_splits,
        WHOLE=whole, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if whole:
        return
    _decode_attention_reduce_kernel[(B, Hq)](
        seq_lens, m, l, acc, out, S,
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1),
        D=D, BLOCK_D=block_d, BLOCK_S=cfg.block_s, N_SPLITS=n_splits, BLOCK_J=16,
        num_warps=2,  # reads n_splits * (D + 2) floats, 16 pieces at a time
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] over k/v [B, S, Hkv, D] -> [B, Hq, D] in q's dtype.

    seq_lens [B] (integers, each in 1..S) is how many cache positions each sequence has
    (the current token's K/V already written); it is read on the device only, so the call
    can be captured in a CUDA graph. `scale` defaults to 1 / sqrt(D). Caches longer than
    `config.split_s` positions are split across programs (two kernels, see the module).
    """
    _check_inputs(q, k_cache, v_cache, seq_lens)
    cfg = config or AttentionConfig()
    _check_config(cfg)
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, Hq, D = q.shape
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _launch(q, k_cache, v_cache, seq_lens.contiguous(), out, scale, cfg)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    B, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k_cache.float().repeat_interleave(Hq // Hkv, dim=2)  # [B, S, Hq, D]
    v = v_cache.float().repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.float() * scale, k)  # [B, Hq, S]
    valid = torch.arange(S, device=q.device)[None, :] < seq_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", scores.softmax(dim=-1), v).to(q.dtype)
