"""Decode's dense projections: out [T, N] = x [T, K] @ W[N, K]^T (+ bias) for a few tokens.

At decode a projection is a matrix-vector product bound by reading W once: each program
owns block_n rows of W and walks K in steps of block_k, keeping per-lane float32 partial
sums [T, block_n, block_k] and reducing them once at the end (a reduction per step would
put a shuffle tree in the loop). Many programs of a few rows each keep enough loads in
flight to read W near the memory's rate, which a GEMM library's M = 1 path may not.

Three tiers: `_linear_kernel` (Triton), `decode_linear()` (launcher: checks, grid) and the
torch reference `decode_linear_ref()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TOKENS = 8  # more rows than this are a GEMM's work (prefill): use torch
MIN_STEP = 16  # columns per reduction step at the least (a 32-byte load of a bf16 row)


@dataclass(frozen=True)
class LinearConfig:
    # 4 rows x 1024 per step: a3b's qkv, o and router with a cold L2 in 18.0 us per layer on
    # an H200 (8 x 256: 28.7 us; cuBLAS 23.1 us), and its 201 MB output head at cuBLAS's rate
    block_n: int = 4  # rows of W per program (rounded up to a power of two)
    block_k: int = 1024  # reduction step (a power of two)
    num_warps: int = 4
    num_stages: int = 3
    # the most tokens a step reads through this kernel (at most MAX_TOKENS); a step of more
    # goes to torch (a GEMM library). On an H100 (bench/results/2026-12-06-h100-r19.md) the
    # GEMM reads the a3b's qkv and output head faster from 2 tokens on (8 tokens: 11.0 against
    # 23.8 us, 220 against 534 us), and an a3b step of 8 sequences ran 11% faster with it
    max_tokens: int = 1


@triton.jit
def _linear_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] or x_ptr when there is none
    out_ptr,  # [T, N]
    T,
    N,
    K,
    stride_xt,
    stride_wn,
    stride_ot,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks in the loop
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    x_rows = x_ptr + t[:, None] * stride_xt  # [BT, 1]
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_rows + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)  # [BT, BN]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out_at = out_ptr + t[:, None] * stride_ot + n[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=(t[:, None] < T) & (n[None, :] < N))


def reduction_step(block_k: int, block_t: int) -> int:
    """The reduction step for `block_t` tokens: the partial sums [T, block_n, block_k] stay the
    tile tuned for one token. Kept whole, a batch's tile grows with T and spills registers: 8
    tokens at the shipped H100/H200 table's 4 x 2048 would hold 64K float32 partial sums, 512
    registers a thread of 4 warps."""
    return max(MIN_STEP, block_k // block_t)


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias [N]) -> [T, N] in x's dtype, T <= MAX_TOKENS;
    float32 accumulation. The weight's rows need a contiguous K."""
    cfg = config or LinearConfig()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected x [T, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    T, K = x.shape
    N = weight.shape[0]
    if T > MAX_TOKENS:
        raise ValueError(f"{T} tokens: decode_linear takes at most {MAX_TOKENS} (use a GEMM)")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {N} output rows")
    if cfg.block_k < 1 or cfg.block_k & (cfg.block_k - 1) or cfg.block_n < 1:
        raise ValueError(f"block_k {cfg.block_k} is not a power of two (or block_n < 1)")
    if not (x.device == weight.device and (bias is None or bias.device == x.device)):
        raise ValueError("x, weight and bias must be on one device")
    if weight.stride(1) != 1:
        raise ValueError("the weight's rows need a contiguous K (a copy would cost more)")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # read as [N] with stride 1
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    block_n, block_t = triton.next_power_of_2(cfg.block_n), triton.next_power_of_2(T)
    block_k = reduction_step(cfg.block_k, block_t)
    _linear_kernel[(triton.cdiv(N, block_n),)](
        x, weight, x if bias is None else bias, out, T, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN=N % block_n == 0 and K % block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def decode_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
