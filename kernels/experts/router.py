"""MoE routing in one launch: softmax over the experts, top-k, and (optionally) the top-k
weights renormalised to sum to one.

The torch sequence (softmax, topk, sum, divide, cast of the ids) is six kernels per layer;
at decode that is launch time, not work. One program per token holds its row of router
logits (E <= a few hundred) in registers and picks the k largest one by one, ties to the
lower expert index; the k weights and ids stay in registers until one store each.
Probabilities are float32 as in the reference `stratad.engine.reference.layers.route`.

Three tiers as everywhere in kernels/: the Triton body, the launcher `route_topk`, and the
torch reference `route_topk_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    w_ptr,  # [T, K] float32 out
    ids_ptr,  # [T, K] int32 out
    E,
    stride_t,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p, 0.0)
    probs = p / tl.sum(p, axis=0)
    left = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks taken or padding
    j = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for n in tl.static_range(K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)  # the lowest index of ties
        w = tl.where(j == n, best, w)
        ids = tl.where(j == n, idx.to(tl.int32), ids)
        left = tl.where(e == idx, -1.0, left)
    if NORMALIZE:
        w = w / tl.sum(w, axis=0)  # slots past K hold 0
    tl.store(w_ptr + t * K + j, w, mask=j < K)
    tl.store(ids_ptr + t * K + j, ids, mask=j < K)


def route_topk(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), the k most
    probable experts by softmax in descending order."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] with contiguous rows, got {tuple(logits.shape)}")
    t, n = logits.shape
    if not 0 < top_k <= n:
        raise ValueError(f"top_k {top_k} is not in 1..{n}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, weights, ids, n, logits.stride(0),
            K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(n),
            NORMALIZE=normalize, num_warps=1,
        )  # fmt: skip
    return weights, ids


def route_topk_ref(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)
