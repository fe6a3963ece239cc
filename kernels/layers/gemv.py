"""Quantized matmul for decode: out [T, N] = x [T, K] @ W^T, W kept as GGUF blocks.

The kernel reads the GGUF blocks [N, row_bytes] directly and dequantizes a tile in registers, so a
weight is read once in its compressed size (the point for a model larger than GPU memory: bandwidth,
not FLOPs, bounds decode). Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, the
i-quants IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and MXFP4 (decoded in
`kernels.formats.iq_decode`; their tables are a byte buffer the kernel reads:
`kernels.formats.iq_tables`). Dequantization follows `kernels/formats/quant.py` (llama.cpp's
formulas) in float32; the products are accumulated in float32.

Three tiers: `_gemv_kernel` (Triton), `gemv()` (launcher: checks, grid), `qmatmul()` (the
operation on a `QTensor`, any leading dims, float weights via torch). `qmatmul_ref()` is
the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.formats.byte_loads import _load_f16, _load_u8
from kernels.formats.iq_decode import IQ_QTYPES, dequant_iq
from kernels.formats.iq_tables import iq_tables as tables_on
from kernels.formats.quant import QTensor, QType, block_geometry

# GGUF type ids as compile-time constants: the kernel is specialized per type.
Q4_0: tl.constexpr = tl.constexpr(int(QType.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(QType.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(QType.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(QType.Q5_1))
Q8_0: tl.constexpr = tl.constexpr(int(QType.Q8_0))
Q2_K: tl.constexpr = tl.constexpr(int(QType.Q2_K))
Q3_K: tl.constexpr = tl.constexpr(int(QType.Q3_K))
Q4_K: tl.constexpr = tl.constexpr(int(QType.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(QType.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(QType.Q6_K))
GEMV_QTYPES: frozenset[QType] = frozenset(
    {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0}
    | {QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K}
    | IQ_QTYPES
)


@dataclass(frozen=True)
class GemvConfig:
    """Launch settings. Defaults are sane everywhere; tuned values come from tables."""

    block_t: int = 1  # tokens per program; >= 16 switches to tl.dot (tensor cores)
    block_n: int = 16  # output rows per program
    block_k: int = 128  # reduction step; any power of two >= 16
    num_warps: int = 4
    num_stages: int = 2


def default_gemv_config(tokens: int) -> GemvConfig:
    """Untuned fallback. One row and a wide K step per program measured 2-3x faster than
    16 x 128 tiles on an H200 (4096 x 4096, T = 1 and 4); tuned tables override this."""
    if tokens >= 16:
        return GemvConfig(block_t=16, block_n=32, block_k=64)
    block_t = triton.next_power_of_2(max(tokens, 1))
    return GemvConfig(block_t=block_t, block_n=1, block_k=min(1024, 4096 // block_t))


# --- Triton ------------------------------------------------------------------------------


@triton.jit
def _k_scale_min(sc_ptr, sub, mask):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block `sub` (0..7) from the 12 packed bytes."""
    low = sub % 4
    b_d = _load_u8(sc_ptr + low, mask)  # bytes 0-3: scales 0-3, top bits of scales 4-7
    b_m = _load_u8(sc_ptr + 4 + low, mask)  # bytes 4-7: mins 0-3, top bits of mins 4-7
    b_hi = _load_u8(sc_ptr + 8 + low, mask)  # bytes 8-11: low nibbles of scales/mins 4-7
    sc = tl.where(sub < 4, b_d & 63, (b_hi & 0xF) | ((b_d >> 6) << 4))
    mn = tl.where(sub < 4, b_m & 63, (b_hi >> 4) | ((b_m >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q5_values(qh_ptr, j, mask):
    """Q5_0/Q5_1 quants 0..31 of values j (0..31): the 4 bytes of 5th bits at qh_ptr, then
    16 bytes of nibbles (values 0-15 low, 16-31 high)."""
    q = (_load_u8(qh_ptr + 4 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
    return q | (((_load_u8(qh_ptr + j // 8, mask) >> (j % 8)) & 1) << 4)


@triton.jit
def _dequant_q23_k(row_ptr, ks, mask, THREE_BIT: tl.constexpr):
    """Q2_K (84-byte blocks: scales 16 | qs 64 | d | dmin) or Q3_K (110: hmask 32 | qs 64 |
    scales 12 | d). A 128-value half n holds 2-bit codes q[32n + l] at shift 2j for values
    128n + 32j + l; sub-block (16 values) s = 8n + 2j + l // 16 has its own scale."""
    i = ks % 256
    n = i // 128
    j = (i % 128) // 32
    l = i % 32
    s = 8 * n + 2 * j + l // 16
    if THREE_BIT:
        blk = row_ptr + (ks // 256) * 110
        q = (_load_u8(blk + 32 + 32 * n + l, mask) >> (2 * j)) & 3
        q = q - 4 * (1 - ((_load_u8(blk + l, mask) >> (4 * n + j)) & 1))  # a clear high bit: -4
        low = (_load_u8(blk + 96 + s % 8, mask) >> (4 * (s // 8))) & 0xF
        high = (_load_u8(blk + 104 + s % 4, mask) >> (2 * (s // 4))) & 3
        w = (_load_f16(blk + 108, mask) * ((low | (high << 4)) - 32).to(tl.float32)) * q.to(
            tl.float32
        )
    else:
        blk = row_ptr + (ks // 256) * 84
        q = (_load_u8(blk + 16 + 32 * n + l, mask) >> (2 * j)) & 3
        sc = _load_u8(blk + s, mask)
        dl = _load_f16(blk + 80, mask) * (sc & 0xF).to(tl.float32)
        w = dl * q.to(tl.float32) - _load_f16(blk + 82, mask) * (sc >> 4).to(tl.float32)
    return w


@triton.jit
def _dequant_q45_k(row_ptr, ks, mask, FIVE_BIT: tl.constexpr):
    """Q4_K (144-byte blocks) or Q5_K (176: a 32-byte plane of 5th bits before the qs)."""
    if FIVE_BIT:
        blk = row_ptr + (ks // 256) * 176
        qs = blk + 48
    else:
        blk = row_ptr + (ks // 256) * 144
        qs = blk + 16
    i = ks % 256
    sub = i // 32  # 8 sub-blocks of 32; pairs share 32 bytes (low, then high nibble)
    j = i % 32
    sc, mn = _k_scale_min(blk + 4, sub, mask)
    q = (_load_u8(qs + (sub // 2) * 32 + j, mask) >> ((sub % 2) * 4)) & 0xF
    if FIVE_BIT:
        q = q | (((_load_u8(blk + 16 + j, mask) >> sub) & 1) << 4)
    d = _load_f16(blk, mask)
    dmin = _load_f16(blk + 2, mask)
    return (d * sc) * q.to(tl.float32) - dmin * mn


@triton.jit
def _dequant_tile(row_ptr, ks, mask, tab_ptr, QTYPE: tl.constexpr):
    """Float32 weights for byte pointers to row starts `row_ptr` [BN, 1] and columns
    `ks` [1, BK]; masked-off entries are 0. Each element locates its own block, so the
    tile need not align with blocks. `tab_ptr`: the i-quants' tables
    (`kernels.formats.iq_tables`)."""
    if QTYPE == Q8_0:
        blk = row_ptr + (ks // 32) * 34
        d = _load_f16(blk, mask)
        q = tl.load(blk + 2 + ks % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * d
    elif QTYPE == Q4_0:
        blk = row_ptr + (ks // 32) * 18
        j = ks % 32  # values 0-15 are low nibbles of bytes 0-15, 16-31 the high nibbles
        d = _load_f16(blk, mask)
        q = (_load_u8(blk + 2 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = d * (q - 8).to(tl.float32)
    elif QTYPE == Q4_1:
        blk = row_ptr + (ks // 32) * 20
        j = ks % 32
        d = _load_f16(blk, mask)
        m = _load_f16(blk + 2, mask)
        q = (_load_u8(blk + 4 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = d * q.to(tl.float32) + m
    elif QTYPE == Q5_0:  # d | qh (bit j: value j's 5th bit) | qs as Q4_0's
        blk = row_ptr + (ks // 32) * 22
        w = _load_f16(blk, mask) * (_q5_values(blk + 2, ks % 32, mask) - 16).to(tl.float32)
    elif QTYPE == Q5_1:  # d | m | qh | qs
        blk = row_ptr + (ks // 32) * 24
        w = _load_f16(blk, mask) * _q5_values(blk + 4, ks % 32, mask).to(tl.float32)
        w = w + _load_f16(blk + 2, mask)
    elif QTYPE == Q2_K:
        w = _dequant_q23_k(row_ptr, ks, mask, False)
    elif QTYPE == Q3_K:
        w = _dequant_q23_k(row_ptr, ks, mask, True)
    elif QTYPE == Q4_K:
        w = _dequant_q45_k(row_ptr, ks, mask, False)
    elif QTYPE == Q5_K:
        w = _dequant_q45_k(row_ptr, ks, mask, True)
    elif QTYPE == Q6_K:  # ql 128 | qh 64 | int8 scales 16 | d
        blk = row_ptr + (ks // 256) * 210
        i = ks % 256
        half = i // 128
        r = i % 128
        ql = (_load_u8(blk + half * 64 + r % 64, mask) >> ((r // 64) * 4)) & 0xF
        qh = (_load_u8(blk + 128 + half * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        sc = tl.load(blk + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _load_f16(blk + 208, mask)
        w = (d * sc.to(tl.float32)) * ((ql | (qh << 4)) - 32).to(tl.float32)
    else:
        w = dequant_iq(row_ptr, ks, mask, tab_ptr, QTYPE)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr,  # [T, K] float
    w_ptr,  # [N, row_bytes] uint8 GGUF blocks
    out_ptr,  # [T, N]
    tab_ptr,  # the i-quants' tables
    T,
    N,
    K,
    stride_xt,
    stride_wn,
    stride_ot,
    QTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    x_rows = x_ptr + toks[:, None].to(tl.int64) * stride_xt  # [BT, 1]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        kmask = (rows[:, None] < N) & (ks < K)
        w = _dequant_tile(row_ptr, ks, kmask, tab_ptr, QTYPE)  # [BN, BK]
        x = tl.load(x_rows + ks, mask=(toks[:, None] < T) & (ks < K), other=0.0)  # [BT, BK]
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + toks[:, None].to(tl.int64) * stride_ot + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(toks[:, None] < T) & (rows[None, :] < N))


# --- launcher ----------------------------------------------------------------------------


def gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: QType,
    n_cols: int,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [T, K] (f32/f16/bf16) @ dequant(blocks [N, row_bytes])^T -> [T, N] in x's dtype.

    `n_cols` is K (the weight's logical column count). `blocks` may have any row stride
    but each row must be contiguous.
    """
    if qtype not in GEMV_QTYPES:
        raise ValueError(f"gemv has no kernel for {qtype.name}")
    if x.dim() != 2 or blocks.dim() != 2:
        raise ValueError(
            f"expected x [T, K] and blocks [N, row_bytes], got {x.shape}, {blocks.shape}"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if blocks.dtype != torch.uint8:
        raise TypeError(f"blocks must be uint8, got {blocks.dtype}")
    if x.device != blocks.device:
        raise ValueError(f"x on {x.device} but blocks on {blocks.device}")
    block, nbytes = block_geometry(qtype)
    T, K = x.shape
    N = blocks.shape[0]
    if n_cols != K or K % block or blocks.shape[1] != K // block * nbytes:
        raise ValueError(
            f"x has {K} columns; {qtype.name} blocks {tuple(blocks.shape)} hold {n_cols}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    if blocks.stride(-1) != 1:
        blocks = blocks.contiguous()
    cfg = config or default_gemv_config(T)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(T, cfg.block_t))
    _gemv_kernel[grid](
        x, blocks, out, tables_on(x.device), T, N, K, x.stride(0), blocks.stride(0),
        out.stride(0),
        QTYPE=int(qtype), BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=cfg.block_t >= 16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# --- operation and reference ---------------------------------------------------------------


def qmatmul(x: torch.Tensor, w: QTensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] @ w^T for a 2-D weight w [N, K] -> [..., N] in x's dtype."""
    if len(w.shape) != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {w.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [T, K]
    if w.is_float:
        out = x2 @ w.data.to(x.dtype).t()
    else:
        out = gemv(x2, w.data, w.qtype, w.shape[1], config)
    return out.reshape(*lead, w.shape[0])


def qmatmul_ref(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Torch reference: dequantize, then matmul in float32."""
    return (x.float() @ w.dequantize().t()).to(x.dtype)
