"""Decode attention: one query token per sequence over its KV cache, with GQA.

q [B, Hq, D] attends to the first seq_lens[b] positions of k/v caches [B, S, Hkv, D]
(any strides with a contiguous last dim, so a slot of a larger cache pool is a view).
Query head h reads KV head h // (Hq / Hkv), as Hugging Face's repeat_kv and llama.cpp do.
Scores, softmax and the weighted sum are float32 (online softmax over blocks of S).

One program serves all query heads of one KV head, so each K/V row is read once per
group rather than once per query head: decode attention is bound by reading the cache.

Three tiers: `_decode_attention_kernel` (Triton), `decode_attention()` (launcher), and the
torch reference `decode_attention_ref()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionConfig:
    block_s: int = 64  # cache positions per step
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [B, S, Hkv, D]
    v_ptr,  # [B, S, Hkv, D]
    len_ptr,  # [B]
    out_ptr,  # [B, Hq, D]
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BG]
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32) * scale  # [BG, BD]

    seq_len = tl.load(len_ptr + b)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, seq_len, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BS]
        kv_mask = (s[:, None] < seq_len) & (d[None, :] < D)
        rows = s[:, None].to(tl.int64)
        k = tl.load(k_base + rows * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BG, BS]
        scores = tl.where(s[None, :] < seq_len, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp(scores - m_new[:, None])  # [BG, BS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rows * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    out_at = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=q_mask)


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
    (the current token's K/V already written). `scale` defaults to 1 / sqrt(D).
    """
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
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(
            "KV caches need a contiguous head dim (copying one per step would "
            "cost more than the attention)"
        )
    cfg = config or AttentionConfig()
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    group = Hq // Hkv
    _decode_attention_kernel[(B, Hkv)](
        q, k_cache, v_cache, seq_lens.contiguous(), out,
        1.0 / math.sqrt(D) if scale is None else scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        D=D, GROUP=group, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=triton.next_power_of_2(D), BLOCK_S=cfg.block_s,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
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
