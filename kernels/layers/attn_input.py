"""Decode attention's input in one launch: from a token's fused q|k|v projection, per-head
RMSNorm of q and k (Qwen3's qk-norm, optional), RoPE by position tables, the new key and
value written into the KV cache at their position, and the rotated queries returned. The
tokens may belong to different sequences of one pool of KV blocks, each token's row found
through its sequence's block table (`block_tables`, the paged layout of
`kernels.layers.paged`): a decode batch in one launch. With `k_scale`/`v_scale` the caches are
int8 (`kernels.formats.kv_int8`): the k (after its rotation, rounded to the compute dtype) and
the v are written quantized per (token, KV head), with their scales.

Unfused, this is six launches per layer (two norms, two rotations, two cache writes), each
a few microseconds of launch for a few kilobytes of work. One program per (token, head):
q heads, then k heads, then v heads, as they lie in the projection's row. Each step rounds
to the compute dtype where the unfused ops store (after the norm, after the rotation), so
the two paths agree to a rounding.

Three tiers: `_attn_input_kernel` (Triton), `attn_input` (launcher), `attn_input_ref`
(the unfused torch composition).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats.kv_int8 import quantize_kv
from kernels.layers.kv_quant import quantize_halves
from kernels.layers.norm import rmsnorm_ref
from kernels.layers.paged import check_block_tables, pool_rows
from kernels.layers.rope import RopeStyle, rope_pairs, rope_rotate


@triton.jit
def _store_head(cache_ptr, scale_ptr, at, first, second, x1, x2, inside, held, D: tl.constexpr,
                QUANT: tl.constexpr):  # fmt: skip
    """One head's halves x1/x2 into cache row `at`: as they are, or (QUANT) as int8 with the
    head's scale (`kernels.formats.kv_int8`); `inside`/`held`: the stores' masks."""
    if QUANT:
        q1, q2, scale = quantize_halves(x1.to(tl.float32), x2.to(tl.float32))
        tl.store(cache_ptr + at * D + first, q1, mask=inside)
        tl.store(cache_ptr + at * D + second, q2, mask=inside)
        tl.store(scale_ptr + at, scale, mask=held)
    else:
        tl.store(cache_ptr + at * D + first, x1, mask=inside)
        tl.store(cache_ptr + at * D + second, x2, mask=inside)


@triton.jit
def _attn_input_kernel(
    qkv_ptr,  # [T, (HQ + 2 HKV) * D]
    pos_ptr,  # [T] int
    qw_ptr,  # [D] q-norm weight (NORM)
    kw_ptr,  # [D] k-norm weight (NORM)
    cos_ptr,  # [P, HALF] float32, by position
    sin_ptr,
    q_ptr,  # [T, HQ, D] out
    k_cache_ptr,  # [S, HKV, D] (PAGED: the pool [n_slots, HKV, D]); int8 (QUANT)
    v_cache_ptr,  # [S, HKV, D] (PAGED: the pool [n_slots, HKV, D]); int8 (QUANT)
    ks_ptr,  # [S, HKV] float32 k scales (QUANT); else unread
    vs_ptr,  # [S, HKV] float32 v scales (QUANT); else unread
    table_ptr,  # [T, max_blocks] int32: token t's sequence's block ids (PAGED); else unread
    stride_t,
    stride_tt,  # table_ptr's row stride
    reach,  # positions a cache holds (S; PAGED: max_blocks * PAGE)
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,  # positions per block (PAGED)
    QUANT: tl.constexpr,  # int8 caches with per (row, head) scales
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    first, second = rope_pairs(i, HALF, NEOX)
    src = qkv_ptr + t * stride_t + h * D
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # A position past the cache's reach writes no k/v (rather than past the cache or the
    # table row: a value read on the device cannot raise).
    held = (pos >= 0) & (pos < reach)
    # [HALF]: the k/v stores' mask, all or none (one comparison: Triton's interpreter takes
    # no store mask made by & of a scalar and a vector)
    inside = i < tl.where(held, HALF, 0)
    if PAGED:  # the pool row: the block's slot 0, plus the offset in the block
        block = tl.load(table_ptr + t * stride_tt + tl.where(held, pos // PAGE, 0))
        row = block.to(tl.int64) * PAGE + pos % PAGE
    else:
        row = pos
    x1 = tl.load(src + first)
    x2 = tl.load(src + second)
    dtype = x1.dtype
    if h >= HQ + HKV:  # a value head: into the cache as it is
        at = row * HKV + (h - HQ - HKV)
        _store_head(v_cache_ptr, vs_ptr, at, first, second, x1, x2, inside, held, D, QUANT)
    else:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if NORM:
            if h < HQ:
                w1 = tl.load(qw_ptr + first).to(tl.float32)
                w2 = tl.load(qw_ptr + second).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + first).to(tl.float32)
                w2 = tl.load(kw_ptr + second).to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / D + eps)
            a = (a * rstd * w1).to(dtype).to(tl.float32)  # stored by the unfused norm
            b = (b * rstd * w2).to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + pos * HALF + i)
        sin = tl.load(sin_ptr + pos * HALF + i)
        y1, y2 = rope_rotate(a, b, cos, sin)
        y1, y2 = y1.to(dtype), y2.to(dtype)
        if h < HQ:
            tl.store(q_ptr + (t * HQ + h) * D + first, y1)
            tl.store(q_ptr + (t * HQ + h) * D + second, y2)
        else:
            at = row * HKV + (h - HQ)  # the k as the unquantized path stores it (then quantized)
            _store_head(k_cache_ptr, ks_ptr, at, first, second, y1, y2, inside, held, D, QUANT)


def _check_cache_dtypes(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Whether the caches are int8 with scales (checked), else that they share qkv's dtype."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together (both for int8 caches, or neither)")
    if k_scale is None or v_scale is None:
        if not (qkv.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError(
                f"qkv and the caches must share a dtype, got {qkv.dtype}, {k_cache.dtype}, "
                f"{v_cache.dtype} (int8 caches take k_scale and v_scale)"
            )
        return False
    rows = k_cache.shape[:2]
    if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8 or not qkv.is_floating_point():
        raise ValueError(
            f"with k_scale/v_scale the caches must be int8 and qkv float, got {k_cache.dtype}, "
            f"{v_cache.dtype}, {qkv.dtype}"
        )
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.dtype != torch.float32 or sc.shape != rows or not sc.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous float32 {list(rows)} (the cache's [S, Hkv]), got "
                f"{sc.dtype} {tuple(sc.shape)}"
            )
        if sc.device != k_cache.device:
            raise ValueError(f"{name} is on {sc.device}, the caches on {k_cache.device}")
    return True


def attn_input(
    qkv: torch.Tensor,
    pos: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    style: RopeStyle,
    eps: float,
    *,
    block_tables: torch.Tensor | None = None,
    block_size: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] at positions pos [T] -> rotated q [T, Hq, D]; the rotated k
    and the v go into k_cache/v_cache [S, Hkv, D] at pos. `norms`: per-head (q, k) RMSNorm
    weights [D], or None. cos/sin: float32 [P, D/2] tables by position (full rotation).

    `block_tables` [T, max_blocks] int32 on the device (row t: token t's sequence's block
    ids) and `block_size` (a power of two): k_cache/v_cache are the pools [n_slots, Hkv, D]
    of the paged layout (`kernels.layers.paged`), and token t's k and v go into pool row
    block_tables[t, pos[t] // block_size] * block_size + pos[t] % block_size. A position
    outside 0..S-1 (paged: 0..max_blocks * block_size - 1) writes no k/v; every id the kernel
    reads must be a block of the pool.

    `k_scale`/`v_scale` float32 [S, Hkv] (contiguous; both or neither): k_cache/v_cache are
    int8, and each row's k and v are written quantized (`kernels.formats.kv_int8`) with
    their scales beside them, in either layout. q is still returned in qkv's dtype."""
    s, hkv, d = k_cache.shape
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [S, Hkv, D] of one shape")
    if qkv.dim() != 2 or qkv.stride(1) != 1 or (qkv.shape[1] - 2 * hkv * d) % d:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (Hq + 2 Hkv) * {d}]")
    hq = (qkv.shape[1] - 2 * hkv * d) // d
    if cos.shape != sin.shape or cos.shape[1] * 2 != d or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [P, {d // 2}], got {tuple(cos.shape)}")
    if d & (d - 1) or hq < 1:
        raise ValueError(f"head dim {d} must be a power of two, with at least one q head")
    if pos.shape != (qkv.shape[0],) or pos.is_floating_point():
        raise ValueError(f"pos must be integers [{qkv.shape[0]}]")
    if not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("the cos/sin tables must be contiguous")
    quant = _check_cache_dtypes(qkv, k_cache, v_cache, k_scale, v_scale)
    if block_tables is not None:
        check_block_tables(block_tables, block_size, qkv.shape[0], s, qkv.device)
        reach = block_tables.shape[1] * block_size
    elif block_size:
        raise ValueError(f"block_size {block_size} without block_tables")
    else:
        reach = s
    q = torch.empty((qkv.shape[0], hq, d), dtype=qkv.dtype, device=qkv.device)
    if qkv.shape[0]:
        qw, kw = norms if norms is not None else (cos, cos)  # unread without NORM
        _attn_input_kernel[(qkv.shape[0], hq + 2 * hkv)](
            qkv, pos, qw, kw, cos, sin, q, k_cache, v_cache,
            k_scale if k_scale is not None else cos, v_scale if v_scale is not None else cos,
            block_tables if block_tables is not None else pos, qkv.stride(0),
            block_tables.stride(0) if block_tables is not None else 0, reach, eps,
            HQ=hq, HKV=hkv, D=d, HALF=d // 2, NEOX=RopeStyle(style) == RopeStyle.NEOX,
            NORM=norms is not None, PAGED=block_tables is not None,
            PAGE=block_size if block_tables is not None else 1, QUANT=quant,
            num_warps=1 if d <= 128 else 2,
        )  # fmt: skip
    return q


def attn_input_ref(
    qkv: torch.Tensor,
    pos: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    style: RopeStyle,
    eps: float,
    *,
    block_tables: torch.Tensor | None = None,
    block_size: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused composition, in torch (paged: k/v_cache are the pools, each token's row
    through its row of block_tables; with k_scale/v_scale, int8 caches written by
    `quantize_kv`)."""
    _, hkv, d = k_cache.shape
    t = qkv.shape[0]
    q, k, v = qkv.split([qkv.shape[1] - 2 * hkv * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, -1, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    if norms is not None:
        q, k = rmsnorm_ref(q, norms[0], eps), rmsnorm_ref(k, norms[1], eps)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        xf = x.float()
        if RopeStyle(style) == RopeStyle.NEOX:
            a, b = xf[..., : d // 2], xf[..., d // 2 :]
            return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)

    rows = pos if block_tables is None else pool_rows(block_tables, pos[:, None], block_size)[:, 0]
    k = rotate(k)
    if k_scale is not None and v_scale is not None:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        k_scale.index_copy_(0, rows, ks)
        v_scale.index_copy_(0, rows, vs)
    k_cache.index_copy_(0, rows, k)
    v_cache.index_copy_(0, rows, v)
    return rotate(q)
