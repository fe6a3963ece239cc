"""Decode attention: one query token per sequence over its KV cache, with GQA.

q [B, Hq, D] attends to the first seq_lens[b] positions of k/v caches [B, S, Hkv, D]
(any strides with a contiguous last dim, so a slot of a larger cache pool is a view), or of
one pool of KV blocks shared by all sequences [n_slots, Hkv, D] read through each sequence's
row of `block_tables` (the paged layout of `kernels.layers.paged`: each K/V row of a step is
gathered by its slot).
Query head h reads KV head h // (Hq / Hkv), as Hugging Face's repeat_kv and llama.cpp do.
Scores, softmax and the weighted sum accumulate in float32 (online softmax over blocks of S).

The caches may be int8 with float32 scales per (position, KV head) (`k_scale`, `v_scale`:
the format of `kernels.formats.kv_int8`), read as they are: the ints widen to the dot's
dtype (exactly: |q| <= 127), each K row's scores are multiplied by its k scale, and each V
row's softmax weight by its v scale before the second dot. No dequantized copy is made.
A paged pool may also be 4-bit (`kernels.formats.kv_q4`: uint8 codes [n_slots, Hkv, D / 2],
float16 (scale, minimum) pairs per 32 values as `k_scale`/`v_scale`): each step's rows are
dequantized in registers from their codes, then dotted as floats.

A paged pool may have a second tier (`host`, `kernels.layers.paged.HostPages`): the blocks
from `first_block` on live in other tensors, typically page-locked RAM mapped for the GPU, a
long context's older blocks. Each step loads its rows from both tiers, each load masked to
the rows it holds (a masked-off row costs no memory traffic), and adds the two.

One program serves all query heads of one KV head, so each K/V row is read once per
group rather than once per query head: decode attention is bound by reading the cache.

Split-K ("flash-decoding"): a grid of (B, Hkv) alone is a handful of programs, each
walking the whole sequence, so the sequence is cut into P pieces, P = min(cdiv(S, split_s),
max_splits) for a cache of S positions (paged: S = max_blocks * block_size, the most a
sequence's table reaches). The pieces share the sequence's *current* length:
each holds cdiv(seq_len, P) positions rounded up to whole steps of block_s, so a short
sequence in a long cache is still spread over the GPU and no program walks empty positions
(a grid sized by S alone would launch hundreds of programs per head that do nothing).

`_decode_attention_kernel` runs on (B, Hkv, P). Per step of block_s positions, the group's
scores and the weighted sum are two tensor-core dots (the group padded to 16 rows), in
float32 accumulation, with the softmax in base 2. Each program writes, per query head, the
float32 running max m, sum l and unnormalised weighted sum acc [D] of its piece, then counts
itself done on a per-(sequence, KV head) counter. The program that counts last of the n
pieces that hold positions (n = cdiv(seq_len, piece)) merges them,
out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j with M = max_j m_j, and sets the
counter back to zero: one launch per call, no second kernel. A piece past seq_len returns at
once (no write, no count), so a cap of many pieces costs a short context only the launch
of programs that exit; when n is 1 (always so when P is 1) that piece is the whole answer
and its program writes it directly. The grid and every
host-side value depend on shapes and the config only, never on the values of seq_lens, so
a launch can be captured in a CUDA graph and replayed as they grow.

gpt-oss's layers add two things. A sliding-window layer (`window`) attends to each
sequence's last `window` positions: the pieces share those alone, so positions before them
are never read. Attention sinks (`sinks`, a logit per query head) join the softmax's sum
and weigh no value: the merge (or a piece that is the whole answer) adds 2^(sink - M) to the
sum after taking the sink into the common max M.

Three tiers: the Triton kernel above, `decode_attention()` (launcher), and the torch
reference `decode_attention_ref()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.formats.kv_int8 import dequantize_kv
from kernels.formats.kv_q4 import dequantize_kv4
from kernels.layers.paged import HostPages, check_block_tables, gather_pages

_LOG2E = 1.4426950408889634  # scores in base 2: exp2 is one instruction
LOG2E: tl.constexpr = tl.constexpr(_LOG2E)  # the same inside the kernels (a global they read)
_MERGE_J = 8  # pieces merged per step


@dataclass(frozen=True)
class AttentionConfig:
    block_s: int = 64  # cache positions per step (a power of two)
    split_s: int = 512  # a cache of S positions is cut into cdiv(S, split_s) pieces...
    max_splits: int = 64  # ...at most this many per sequence and KV head
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _pool_rows(table, s, live, first_host, PAGE: tl.constexpr, HOST: tl.constexpr):
    """Positions s [BS] of a sequence's block table as pool rows: (the first tier's row, the
    host tier's row, whether the host tier holds it), each [BS]. A position's row is its
    block's slot 0 plus its offset; a row the other tier holds reads row 0 of this one (its
    load is masked off)."""
    block = tl.load(table + s // PAGE, mask=live, other=0)
    on_host = s < 0  # none without a host tier
    host_row = s.to(tl.int64)
    if HOST:
        on_host = block >= first_host
        host_row = tl.where(on_host, block - first_host, 0).to(tl.int64) * PAGE + s % PAGE
        block = tl.where(on_host, 0, block)
    return block.to(tl.int64) * PAGE + s % PAGE, host_row, on_host


@triton.jit
def _load_tiers(base, hbase, at, hat, mask, on_host, HOST: tl.constexpr):
    """Values at offsets `at` of the first tier, or (HOST) at `hat` of the host tier where
    `on_host`: two loads, each masked to its tier's rows (0 where masked)."""
    if HOST:
        x = tl.load(base + at, mask=mask & ~on_host, other=0)
        x += tl.load(hbase + hat, mask=mask & on_host, other=0)
    else:
        x = tl.load(base + at, mask=mask, other=0)
    return x


@triton.jit
def _attend(
    q,  # [BG, BD] in the dot's dtype (rows past the group are zero)
    k_base,  # K/V of one sequence and KV head at position 0 (PAGED: of the pool at slot 0)
    v_base,
    stride_ks,
    stride_vs,
    table,  # the sequence's block ids (PAGED); else unread
    ks_base,  # k/v scales of the sequence and KV head at position 0 (QUANT); else unread
    vs_base,
    stride_kss,
    stride_vss,
    start,
    end,
    scale,  # the softmax scale times log2(e): scores are in base-2 units
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_F32: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,  # positions per block (PAGED)
    QUANT: tl.constexpr,  # 1: int8 K/V, each row scaled by its ks/vs (4-bit: `_attend_q4`)
    hk_base,  # the host tier's K/V/scales at slot 0 of the KV head (HOST); else unread
    hv_base,
    hks_base,
    hvs_base,
    first_host,  # the first block id of the host tier (HOST)
    HOST: tl.constexpr,  # PAGED with a second tier: blocks >= first_host read from it
):
    """Online softmax of q over positions [start, end): (max m [BG], sum of 2^(s - m) l [BG],
    unnormalised weighted sum acc [BG, BD]), scores s in base-2 units; m = -inf, l = 0,
    acc = 0 when empty. Both products are tensor-core dots with float32 accumulation
    (DOT_F32: float32 operands, for the interpreter, whose dot cannot take bfloat16; QUANT:
    the ints widened to q's dtype)."""
    d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BS]
        live = s < end
        if PAGED:
            srow, host_row, on_host = _pool_rows(table, s, live, first_host, PAGE, HOST)
        else:
            srow, host_row, on_host = s.to(tl.int64), s.to(tl.int64), s < 0
        rows, hrows, host2 = srow[:, None], host_row[:, None], on_host[:, None]
        kv_mask = live[:, None] & (d[None, :] < D)
        k = _load_tiers(k_base, hk_base, rows * stride_ks + d[None, :],
                        hrows * stride_ks + d[None, :], kv_mask, host2, HOST)  # fmt: skip
        v = _load_tiers(v_base, hv_base, rows * stride_vs + d[None, :],
                        hrows * stride_vs + d[None, :], kv_mask, host2, HOST)  # fmt: skip
        if QUANT == 1:  # [BS] the rows' scales (0 past end, where the weight is 0 anyway)
            ks = _load_tiers(ks_base, hks_base, srow * stride_kss, host_row * stride_kss,
                             live, on_host, HOST)  # fmt: skip
            vs = _load_tiers(vs_base, hvs_base, srow * stride_vss, host_row * stride_vss,
                             live, on_host, HOST)  # fmt: skip
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        elif DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BG, BS]
        if QUANT == 1:
            scores = scores * ks[None, :]
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, scores, live)
        if QUANT == 1:
            p = p * vs[None, :]  # after the sum: l counts the weights, not the scales
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_i, l_i, acc


@triton.jit
def _softmax_step(m_i, l_i, scores, live):
    """One step of the online softmax over scores [BG, BS] (positions not `live` masked):
    the new max and sum, the factor that rescales what was summed under the old max, and
    the step's weights p [BG, BS]."""
    scores = tl.where(live[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _q4_halves(
    base, hbase, dm_base, dm_hbase, rows, hrows, stride, stride_dm, mask, live, on_host,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HOST: tl.constexpr,
):  # fmt: skip
    """4-bit rows as their even and odd values, each [BS, BD / 2] float32: byte j holds
    values 2j (low nibble) and 2j + 1 (high), both of group j // 16, whose (scale, minimum)
    are read as [BS, BD / 32] and spread over its 16 bytes. `mask` [BS, BD / 2] the codes',
    `live` [BS, 1] the rows'."""
    j = tl.arange(0, BLOCK_D // 2)
    codes = _load_tiers(base, hbase, rows * stride + j[None, :], hrows * stride + j[None, :],
                        mask, on_host, HOST)  # fmt: skip
    gi = tl.arange(0, BLOCK_D // 32) * 2
    at, hat = rows * stride_dm + gi[None, :], hrows * stride_dm + gi[None, :]
    sc = _load_tiers(dm_base, dm_hbase, at, hat, live, on_host, HOST).to(tl.float32)
    mn = _load_tiers(dm_base, dm_hbase, at + 1, hat + 1, live, on_host, HOST).to(tl.float32)
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_S, BLOCK_D // 32, 16]),
                    [BLOCK_S, BLOCK_D // 2])  # fmt: skip
    mn = tl.reshape(tl.broadcast_to(mn[:, :, None], [BLOCK_S, BLOCK_D // 32, 16]),
                    [BLOCK_S, BLOCK_D // 2])  # fmt: skip
    return (codes & 15).to(tl.float32) * sc + mn, (codes >> 4).to(tl.float32) * sc + mn


@triton.jit
def _attend_q4(
    q_even,  # [BG, BD / 2] q's even values, in the dot's dtype
    q_odd,  # [BG, BD / 2] its odd values
    k_base,  # 4-bit codes [n_slots, Hkv, D / 2] of the pool at slot 0 of the KV head
    v_base,
    stride_ks,
    stride_vs,
    table,
    ks_base,  # (scale, minimum) pairs [n_slots, Hkv, D / 32, 2] at slot 0 of the KV head
    vs_base,
    stride_kss,
    stride_vss,
    start,
    end,
    scale,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PAGE: tl.constexpr,
    hk_base,
    hv_base,
    hks_base,
    hvs_base,
    first_host,
    HOST: tl.constexpr,
):
    """`_attend` over a paged 4-bit pool (`kernels.formats.kv_q4`): each step's rows are
    dequantized in registers as their even and odd values, so each product is two dots over
    half the head (no interleaving in the loop); the weighted sum comes back as its even
    and odd halves [BG, BD / 2]."""
    j = tl.arange(0, BLOCK_D // 2)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_even = tl.zeros([BLOCK_G, BLOCK_D // 2], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_G, BLOCK_D // 2], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        live = s < end
        srow, host_row, on_host = _pool_rows(table, s, live, first_host, PAGE, HOST)
        rows, hrows, host2 = srow[:, None], host_row[:, None], on_host[:, None]
        mask = live[:, None] & (j[None, :] < D // 2)
        k_even, k_odd = _q4_halves(k_base, hk_base, ks_base, hks_base, rows, hrows, stride_ks,
                                   stride_kss, mask, live[:, None], host2, BLOCK_S, BLOCK_D,
                                   HOST)  # fmt: skip
        scores = tl.dot(q_even, tl.trans(k_even.to(q_even.dtype)), input_precision="ieee")
        scores += tl.dot(q_odd, tl.trans(k_odd.to(q_odd.dtype)), input_precision="ieee")
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, scores * scale, live)
        v_even, v_odd = _q4_halves(v_base, hv_base, vs_base, hvs_base, rows, hrows, stride_vs,
                                   stride_vss, mask, live[:, None], host2, BLOCK_S, BLOCK_D,
                                   HOST)  # fmt: skip
        pw = p.to(q_even.dtype)
        acc_even = acc_even * alpha[:, None] + tl.dot(pw, v_even.to(q_even.dtype),
                                                      input_precision="ieee")  # fmt: skip
        acc_odd = acc_odd * alpha[:, None] + tl.dot(pw, v_odd.to(q_even.dtype),
                                                    input_precision="ieee")  # fmt: skip
    return m_i, l_i, acc_even, acc_odd


@triton.jit
def _piece(seq_len, N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Positions per piece: the length shared by N_SPLITS pieces, in whole steps."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, N_SPLITS), BLOCK_S), 1) * BLOCK_S


@triton.jit
def _merge(
    m_ptr,
    l_ptr,
    ml_base,  # [BH] offsets of the group's heads in m and l
    acc_base,  # [BH] pointers to the group's heads' partial sums
    stride_aj,
    n_live,
    rows,  # [BH] heads of the group
    sink,  # [BH] the heads' sink logits in base-2 units (-inf: none)
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= the number of pieces
    MERGE_J: tl.constexpr,
):
    """The group's output [BH, BD] from its live pieces' partials, rescaled to their common
    max: sum_j 2^(m_j - M) acc_j / (sum_j 2^(m_j - M) l_j + 2^(sink - M)) with
    M = max(max_j m_j, sink). The loads bypass L1 (.cg): other programs wrote these partials
    during this launch."""
    d = tl.arange(0, BLOCK_D)
    jn = tl.arange(0, BLOCK_N)
    live = rows[:, None] & (jn[None, :] < n_live)  # every live piece has a position
    m_all = tl.load(m_ptr + ml_base[:, None] + jn[None, :], mask=live, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
    l_all = tl.load(l_ptr + ml_base[:, None] + jn[None, :], mask=live, other=0.0,
                    cache_modifier=".cg")  # fmt: skip
    m_max = tl.where(rows, tl.maximum(tl.max(m_all, axis=1), sink), 0.0)  # [BH]
    l_sum = tl.sum(tl.exp2(m_all - m_max[:, None]) * l_all, axis=1) + tl.exp2(sink - m_max)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, n_live, MERGE_J):
        j = j0 + tl.arange(0, MERGE_J)
        here = rows[:, None] & (j[None, :] < n_live)  # [BH, MJ]
        m_j = tl.load(m_ptr + ml_base[:, None] + j[None, :], mask=here, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        w = tl.exp2(m_j - m_max[:, None])  # [BH, MJ]; 0 where not live
        at = acc_base[:, None, None] + j[None, :, None].to(tl.int64) * stride_aj
        part = tl.load(at + d[None, None, :], mask=here[:, :, None] & (d[None, None, :] < D),
                       other=0.0, cache_modifier=".cg")  # fmt: skip
        acc += tl.sum(w[:, :, None] * part, axis=1)
    return acc / tl.where(rows, l_sum, 1.0)[:, None]


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [B, S, Hkv, D] (PAGED: the pool [n_slots, Hkv, D])
    v_ptr,  # [B, S, Hkv, D] (PAGED: the pool [n_slots, Hkv, D])
    len_ptr,  # [B]
    m_ptr,  # [B, Hq, n_splits] float32
    l_ptr,  # [B, Hq, n_splits] float32, strides of m
    acc_ptr,  # [B, Hq, n_splits, D] float32
    count_ptr,  # [B * Hkv] int32, zero between launches
    out_ptr,  # [B, Hq, D]
    table_ptr,  # [B, max_blocks] int32: each sequence's block ids (PAGED); else unread
    ks_ptr,  # [B, S, Hkv] float32 k scales (PAGED: [n_slots, Hkv]) (QUANT); else unread
    vs_ptr,  # [B, S, Hkv] float32 v scales (PAGED: [n_slots, Hkv]) (QUANT); else unread
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
    stride_tb,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    H_KV,
    D: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # >= GROUP and >= 16 (a dot's rows)
    BLOCK_H: tl.constexpr,  # next power of two of GROUP (the merge's rows)
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two of N_SPLITS
    MERGE_J: tl.constexpr,
    DOT_F32: tl.constexpr,
    PAGED: tl.constexpr,  # sequence b's K/V rows through table_ptr[b] (stride_kb is 0)
    PAGE: tl.constexpr,  # positions per block (PAGED)
    QUANT: tl.constexpr,  # 1: int8 K/V with per (row, KV head) scales; 2: 4-bit (PAGED)
    hk_ptr,  # the host tier [n_host_slots, Hkv, D] in the pool's strides (HOST); else unread
    hv_ptr,
    hks_ptr,  # its scales [n_host_slots, Hkv] in the pool's scale strides (HOST and QUANT)
    hvs_ptr,
    first_host,  # the first block id of the host tier
    HOST: tl.constexpr,
    sink_ptr,  # [Hq] float32: each query head's sink logit (SINKS); else unread
    SINKS: tl.constexpr,
    window,  # each query sees its last `window` positions (0: all of them)
):
    """Program (b, KV head, j) over piece j of sequence b's visible positions (`_piece`):
    the last `window` of its seq_len, or all. When one piece holds them all it writes the
    output; else each live piece writes its partials, and the last of them to finish,
    counted on count_ptr, merges them and sets the count back to 0. A piece past seq_len
    returns at once."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    seq_len = tl.minimum(tl.load(len_ptr + b), S)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the first visible
    piece = _piece(seq_len - first, N_SPLITS, BLOCK_S)
    n_live = tl.cdiv(seq_len - first, piece)  # the pieces that hold positions (seq_len >= 1)
    if split >= n_live:  # nothing to read, write or count: the merge skips it
        return
    start = first + split * piece
    end = tl.minimum(start + piece, seq_len)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    ks_base = ks_ptr + b * stride_ksb + kv_head * stride_ksh
    vs_base = vs_ptr + b * stride_vsb + kv_head * stride_vsh
    hk_base, hv_base = hk_ptr + kv_head * stride_kh, hv_ptr + kv_head * stride_vh
    hks_base, hvs_base = hks_ptr + kv_head * stride_ksh, hvs_ptr + kv_head * stride_vsh
    if QUANT == 2:  # q as its even and odd values, as the 4-bit rows are dequantized
        j = tl.arange(0, BLOCK_D // 2)
        half_mask = (g[:, None] < GROUP) & (j[None, :] < D // 2)
        q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh + 2 * j[None, :]
        q_even = tl.load(q_row, mask=half_mask, other=0.0)
        q_odd = tl.load(q_row + 1, mask=half_mask, other=0.0)
        if DOT_F32:
            q_even, q_odd = q_even.to(tl.float32), q_odd.to(tl.float32)
        m_i, l_i, acc_even, acc_odd = _attend_q4(
            q_even, q_odd, k_base, v_base, stride_ks, stride_vs, table_ptr + b * stride_tb,
            ks_base, vs_base, stride_kss, stride_vss, start, end, scale,
            D, BLOCK_G, BLOCK_D, BLOCK_S, PAGE, hk_base, hv_base, hks_base, hvs_base,
            first_host, HOST,
        )  # fmt: skip
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_G, BLOCK_D])  # once, at the end
    else:
        q = tl.load(q_at, mask=q_mask, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        elif not QUANT:  # the cache's dtype; over int8 caches the dot takes q's own
            q = q.to(k_ptr.dtype.element_ty)
        m_i, l_i, acc = _attend(
            q, k_base, v_base, stride_ks, stride_vs, table_ptr + b * stride_tb, ks_base,
            vs_base, stride_kss, stride_vss, start, end, scale,
            D, BLOCK_G, BLOCK_D, BLOCK_S, DOT_F32, PAGED, PAGE, QUANT,
            hk_base, hv_base, hks_base, hvs_base, first_host, HOST,
        )  # fmt: skip
    if n_live == 1:  # this piece is the whole answer (always so when N_SPLITS is 1)
        if SINKS:  # the sink joins the softmax's sum: rescaled to the larger max
            sink = tl.load(sink_ptr + heads, mask=g < GROUP, other=0.0) * LOG2E
            m_all = tl.maximum(m_i, sink)
            acc = acc * tl.exp2(m_i - m_all)[:, None]
            l_i = l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all)
        whole_at = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(whole_at, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        return
    ml_at = b * stride_mb + heads * stride_mh + split
    tl.store(m_ptr + ml_at, m_i, mask=g < GROUP)
    tl.store(l_ptr + ml_at, l_i, mask=g < GROUP)
    acc_at = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + split * stride_aj + d[None, :]
    tl.store(acc_at, acc, mask=q_mask)
    # every thread's stores, then one release-acquire count: the last program sees them all
    tl.debug_barrier()
    count_at = count_ptr + b * H_KV + kv_head
    if tl.atomic_add(count_at, 1, sem="acq_rel", scope="gpu") == n_live - 1:
        tl.atomic_xchg(count_at, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        h = tl.arange(0, BLOCK_H)
        rows = h < GROUP
        group_heads = kv_head * GROUP + h
        if SINKS:
            sink = tl.load(sink_ptr + group_heads, mask=rows, other=0.0) * LOG2E
        else:
            sink = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        out = _merge(
            m_ptr, l_ptr, b * stride_mb + group_heads * stride_mh,
            acc_ptr + b * stride_ab + group_heads * stride_ah, stride_aj,
            n_live, rows, sink, D, BLOCK_H, BLOCK_D, BLOCK_N, MERGE_J,
        )  # fmt: skip
        out_at = out_ptr + b * stride_ob + group_heads[:, None] * stride_oh + d[None, :]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & (d[None, :] < D))


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    paged: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    layout = "pools [n_slots, Hkv, D]" if paged else "[B, S, Hkv, D]"
    if q.dim() != 3 or k_cache.dim() != (3 if paged else 4) or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, Hq, D] and k, v {layout}; got {tuple(q.shape)}"
            f", {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    packed = k_cache.dtype == torch.uint8  # 4-bit codes, two a byte
    if (not paged and k_cache.shape[0] != B) or k_cache.shape[-1] != (D // 2 if packed else D):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{Hq} query heads is not a multiple of {Hkv} KV heads")
    if seq_lens.shape != (B,) or seq_lens.is_floating_point():
        raise ValueError(
            f"seq_lens must be integers [B={B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together (both for int8 caches, or neither)")
    if k_scale is not None and v_scale is not None and packed:
        _check_q4(q, k_cache, v_cache, k_scale, v_scale, paged)
    elif k_scale is not None and v_scale is not None:
        _check_scales(q, k_cache, v_cache, k_scale, v_scale, layout)
    elif not (
        q.is_floating_point() and k_cache.dtype == v_cache.dtype and k_cache.is_floating_point()
    ):
        raise TypeError(
            f"need float q and caches of one float dtype, got {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype} (int8 caches take k_scale and v_scale)"
        )
    if not (q.device == k_cache.device == v_cache.device == seq_lens.device):
        raise ValueError("q, caches and seq_lens must be on one device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(
            "KV caches need a contiguous head dim (copying one per step would "
            "cost more than the attention)"
        )


def _check_scales(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    layout: str,
) -> None:
    if not (q.is_floating_point() and k_cache.dtype == v_cache.dtype == torch.int8):
        raise TypeError(
            f"with k_scale/v_scale: float q and int8 caches, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.dtype != torch.float32 or sc.shape != k_cache.shape[:-1]:
            raise ValueError(
                f"{name} must be float32 {list(k_cache.shape[:-1])} (the caches {layout} less"
                f" D), got {sc.dtype} {tuple(sc.shape)}"
            )
        if sc.device != k_cache.device:
            raise ValueError(f"{name} is on {sc.device}, the caches on {k_cache.device}")


def _check_q4(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    paged: bool,
) -> None:
    """4-bit caches (`kernels.formats.kv_q4`): codes uint8 [n_slots, Hkv, D / 2] of a paged
    pool, (scale, minimum) pairs float16 [n_slots, Hkv, D / 32, 2]."""
    D = q.shape[-1]
    if not paged:
        raise ValueError("4-bit caches are read as paged pools (block_tables)")
    if v_cache.dtype != torch.uint8 or not q.is_floating_point() or D % 32:
        raise TypeError(f"4-bit caches: uint8 codes of a head dim in 32s and float q, got"
                        f" {k_cache.dtype}, {v_cache.dtype}, D {D}, {q.dtype}")  # fmt: skip
    want = (*k_cache.shape[:2], D // 32, 2)
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.dtype != torch.float16 or sc.shape != want or sc.stride()[2:] != (2, 1):
            raise ValueError(f"{name} of 4-bit caches: float16 (scale, minimum) pairs"
                             f" {list(want)}, got {sc.dtype} {tuple(sc.shape)}")  # fmt: skip
        if sc.device != k_cache.device:
            raise ValueError(f"{name} is on {sc.device}, the caches on {k_cache.device}")


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
    counts: torch.Tensor,
    block_tables: torch.Tensor | None,
    block_size: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    host: HostPages | None,
    sinks: torch.Tensor | None,
    window: int,
) -> None:
    B, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    # 0: plain; 1: int8 and a scale per row; 2: 4-bit codes and (scale, minimum) pairs
    quant = 0 if k_scale is None else 2 if k_cache.dtype == torch.uint8 else 1
    if block_tables is None:
        S = k_cache.shape[1]
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    else:  # one pool for every sequence (no batch stride), each reaching its table's blocks
        S = block_tables.shape[1] * block_size
        k_strides, v_strides = (0, *k_cache.stride()[:2]), (0, *v_cache.stride()[:2])
    # the scales' (sequence, position, KV head) strides; unread unless quant
    ks_strides: tuple[int, ...] = (0, 0, 0)
    vs_strides: tuple[int, ...] = (0, 0, 0)
    if k_scale is not None and v_scale is not None:
        pool = block_tables is not None  # [n_slots, Hkv]: no sequence stride
        ks_strides = (0, *k_scale.stride()[:2]) if pool else k_scale.stride()[:3]
        vs_strides = (0, *v_scale.stride()[:2]) if pool else v_scale.stride()[:3]
    group = Hq // Hkv
    n_splits = min(triton.cdiv(S, cfg.split_s), cfg.max_splits)
    # Partials of every piece (none when one piece is the whole cache); those past a
    # sequence's length are never read.
    n_part = 0 if n_splits == 1 else n_splits
    m = torch.empty(B, Hq, n_part, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, Hq, n_part, D, dtype=torch.float32, device=q.device)
    interpreted = q.device.type == "cpu"  # a dot's operands at least 16 wide on a GPU
    block_s = cfg.block_s if interpreted else max(cfg.block_s, 16)
    block_h = triton.next_power_of_2(group)
    unread = seq_lens  # a pointer the kernel is given but never reads
    hk, hv = (host.k, host.v) if host is not None else (unread, unread)
    hks = host.k_scale if host is not None and host.k_scale is not None else unread
    hvs = host.v_scale if host is not None and host.v_scale is not None else unread
    _decode_attention_kernel[(B, Hkv, n_splits)](
        q, k_cache, v_cache, seq_lens, m, l, acc, counts, out,
        block_tables if block_tables is not None else seq_lens,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        scale * _LOG2E, S,
        q.stride(0), q.stride(1), *k_strides, *v_strides,
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0) if block_tables is not None else 0,
        *ks_strides, *vs_strides, Hkv,
        D=D, GROUP=group, BLOCK_G=block_h if interpreted else max(block_h, 16), BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(D) if interpreted else max(triton.next_power_of_2(D), 16),
        BLOCK_S=block_s, N_SPLITS=n_splits, BLOCK_N=triton.next_power_of_2(n_splits),
        MERGE_J=_MERGE_J, DOT_F32=interpreted or q.dtype == torch.float32,
        PAGED=block_tables is not None, PAGE=block_size if block_tables is not None else 1,
        QUANT=quant, hk_ptr=hk, hv_ptr=hv, hks_ptr=hks, hvs_ptr=hvs,
        first_host=host.first_block if host is not None else 0, HOST=host is not None,
        sink_ptr=sinks if sinks is not None else unread, SINKS=sinks is not None,
        window=window, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def attention_counts(batch: int, kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed per-(sequence, KV head) counts `decode_attention(counts=)` takes; the
    kernel leaves them zero, so one buffer serves every call in a stream, and a CUDA graph
    that captures the calls replays them."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    config: AttentionConfig | None = None,
    counts: torch.Tensor | None = None,
    *,
    block_tables: torch.Tensor | None = None,
    block_size: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    host: HostPages | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] over k/v [B, S, Hkv, D] -> [B, Hq, D] in q's dtype.

    seq_lens [B] (integers, each in 1..S) is how many cache positions each sequence has
    (the current token's K/V already written); it is read on the device only, so the call
    can be captured in a CUDA graph. `scale` defaults to 1 / sqrt(D). Caches longer than
    `config.split_s` positions are split across programs (see the module). `counts`
    (`attention_counts`) is the kernel's zeroed scratch; without it each call allocates
    one. Calls running at once on different streams need their own.

    `block_tables` [B, max_blocks] int32 (on the device, rows with a contiguous last dim) and
    `block_size` (a power of two): the paged layout (`kernels.layers.paged`). k/v_cache are
    then the pools [n_slots, Hkv, D] shared by all sequences (no batch dim; n_slots a whole
    number of blocks), and position p of sequence b is pool row
    block_tables[b, p // block_size] * block_size + p % block_size. S is
    max_blocks * block_size: a seq_len past it is read as S. The ids are read on the device
    only (a table updated in place is replayed by a graph); every id the kernel reads must
    be a block of the pool, padding included.

    `k_scale`/`v_scale` float32 (both or neither; any strides), the caches' shape less D
    ([B, S, Hkv], paged [n_slots, Hkv]): k/v_cache are int8 (`kernels.formats.kv_int8`),
    read directly with each row scaled by its scale; q stays a float dtype (the dots run in
    it), the output is in q's dtype.

    `host` (paged only): the pool's second tier, blocks `host.first_block` and above read
    from its tensors (`kernels.layers.paged.HostPages`); the pool then holds those below.

    `sinks` [Hq] float32: a logit per query head that joins each softmax and weighs no value
    (gpt-oss's attention sinks). `window`: each sequence attends to its last `window`
    positions only (a sliding-window layer; 0: all of them).
    """
    paged = block_tables is not None
    _check_sinks(sinks, q, window)
    if block_tables is not None:
        if k_cache.dim() != 3:
            raise ValueError(
                f"with block_tables, k/v_cache are the pools [n_slots, Hkv, D], got"
                f" {tuple(k_cache.shape)}"
            )
        check_block_tables(block_tables, block_size, q.shape[0], k_cache.shape[0], q.device)
    elif block_size:
        raise ValueError(f"block_size {block_size} without block_tables")
    if host is not None:
        if not paged:
            raise ValueError("a host tier extends a paged pool: it needs block_tables")
        host.check(k_cache, k_scale)
    _check_inputs(q, k_cache, v_cache, seq_lens, paged, k_scale, v_scale)
    cfg = config or AttentionConfig()
    _check_config(cfg)
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    if counts is None:
        counts = attention_counts(B, Hkv, q.device)
    elif counts.dtype != torch.int32 or counts.numel() < B * Hkv or counts.device != q.device:
        raise ValueError(
            f"counts must be int32 on {q.device} with at least {B * Hkv} entries, got "
            f"{counts.dtype} [{counts.numel()}] on {counts.device}"
        )
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _launch(
        q, k_cache, v_cache, seq_lens.contiguous(), out, scale, cfg, counts, block_tables,
        block_size, k_scale, v_scale, host, sinks, window,
    )  # fmt: skip
    return out


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor, window: int) -> None:
    if window < 0:
        raise ValueError(f"window {window} is negative (0: no window)")
    if sinks is None:
        return
    if sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],) or sinks.stride(0) != 1:
        raise ValueError(f"sinks must be contiguous float32 [Hq={q.shape[1]}], got"
                         f" {sinks.dtype} {tuple(sinks.shape)}")  # fmt: skip
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


def _dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 or 4-bit rows as float32 (`kv_int8`, `kv_q4`)."""
    if codes.dtype == torch.uint8:
        return dequantize_kv4(codes, scales)
    return dequantize_kv(codes, scales)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    block_tables: torch.Tensor | None = None,
    block_size: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    host: HostPages | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`decode_attention` in torch: over caches [B, S, Hkv, D], or (block_tables, block_size)
    over pools [n_slots, Hkv, D] (and a `host` tier), each sequence's blocks gathered first;
    int8 caches with k_scale/v_scale are dequantized first (a float32 copy: the reference's
    way in); `sinks` join each softmax as a column, `window` hides all but the last
    positions."""
    if k_scale is not None and v_scale is not None:
        k_cache, v_cache = _dequantize(k_cache, k_scale), _dequantize(v_cache, v_scale)
        if host is not None and host.k_scale is not None and host.v_scale is not None:
            host = HostPages(_dequantize(host.k, host.k_scale),
                             _dequantize(host.v, host.v_scale), None, None,
                             host.first_block)  # fmt: skip
    if block_tables is not None:
        first = host.first_block if host is not None else 0
        k_cache = gather_pages(k_cache, block_tables, block_size,  # [B, S, Hkv, D]
                               host.k if host is not None else None, first)  # fmt: skip
        v_cache = gather_pages(v_cache, block_tables, block_size,
                               host.v if host is not None else None, first)  # fmt: skip
    B, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    at = torch.arange(S, device=q.device)[None, :]
    valid = at < seq_lens[:, None]  # [B, S]
    if window:
        valid &= at >= seq_lens[:, None] - window
    k = k_cache.float().repeat_interleave(Hq // Hkv, dim=2)  # [B, S, Hq, D]
    # what lies past a sequence's length is never read (a pool's free slots may hold NaN)
    v = v_cache.float().masked_fill(~valid[:, :, None, None], 0.0)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.float() * scale, k)  # [B, Hq, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    if sinks is not None:  # a column that joins the softmax, then is dropped
        column = sinks.float()[None, :, None].expand(B, Hq, 1)
        probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("bhs,bshd->bhd", probs, v).to(q.dtype)
