"""The offload engine's attention block: the qkv projection, q/k norms, RoPE from position
tables, the KV write, and attention itself, over the paged KV pool (`stratad.engine.kv`).

Decode attends split-K through the caches' block tables, the lengths read on the device (so
one captured graph serves every position); where the model allows, the norms, the rotation and
the KV write are one kernel (`kernels.layers.attn_input`; RoPE over part of each head, GLM-4.5's
and Qwen3-Next's, latent attention and a 4-bit pool are written op by op). A decode step of
several sequences of one pool runs attention and its input once for the whole batch (the
fused kernel or the ops over every row), each sequence's blocks found through its row of the
tables [B, max_blocks] (gathered on the device once per step): a captured step reads them,
so one capture serves every set of caches of its size. A prefill chunk gathers its
sequence's keys and values up to its end and attends with torch's
scaled_dot_product_attention.

Latent attention (DeepSeek-V2/V3, Kimi) caches its latent as llama.cpp does: the pool holds
one KV head a token, the normed kv latent and the shared rotated key (`config.pool_spec`: 512 +
64 values a token and layer for DeepSeek's, the values the keys' tensors, against 128 heads of
192 + 192 expanded and widened for V3). Decode attends over those rows as keys and values,
each head's query taken into the latent through its key expansion (k_b) and the latent
output back through its value expansion (v_b); a prefill chunk expands the rows it gathers
into every head's keys and values and attends with heads of their own width.

Qwen3-Next's gated heads: the q projection's rows also give each head's output gate (its
queries, keys and values first, then the gates), times whose sigmoid the head's output goes
into the output projection.

gpt-oss's attention sinks and sliding-window layers are read by the same decode kernel (its
`sinks` and `window`); a prefill chunk of a sliding layer attends in pieces of query rows in
torch (each reading its window of keys), the sink a column of each softmax; a chunk of a full
layer attends through torch's fused attention, the sink riding as one more key
(`sink_attention`).

An int8 pool (`engine.kv_cache = "int8"`) holds int8 keys and values with a float32 scale per
token and KV head (`kernels.formats.kv_int8`): the fused input kernel writes them, decode
attention reads them directly, and a prefill chunk dequantizes the rows it gathers. A 4-bit
pool (`"q4"`, `kernels.formats.kv_q4`) is read the same way and written op by op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as fn
from torch.nn.attention.bias import causal_lower_right

from kernels.layers.attention import attention_counts, decode_attention
from kernels.layers.attn_input import attn_input
from kernels.layers.rope import RopeStyle, rope_table
from stratad.engine.kv import KVCache, KVPool, block_tables
from stratad.engine.kv_format import Q4, Q4KV, Int8KV
from stratad.engine.offload.config import OffloadConfig, pool_spec
from stratad.engine.offload.dense import DenseLayer, MlaLayer
from stratad.engine.offload.projection import GgufMatrix
from stratad.engine.passes import FUSED_MAX_TOKENS, Decode, Pass
from stratad.engine.reference.layers import apply_rope, attention, rope_tables
from stratad.model.spec import ModelSpec

# x, the weight (dequantized or as GGUF blocks), its bias
Linear = Callable[[torch.Tensor, torch.Tensor | GgufMatrix, torch.Tensor | None], torch.Tensor]
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class OffloadAttention:
    def __init__(
        self, spec: ModelSpec, device: torch.device, config: OffloadConfig, linear: Linear,
        norm: Norm,
    ) -> None:  # fmt: skip
        """`linear(x, weight, bias)` and `norm(x, weight, eps)`: the engine's projections
        (GEMV for a few tokens) and RMS norm."""
        self.spec, self.device, self.linear, self.norm = spec, device, linear, norm
        self.config = config.kernels.attention
        self.cos, self.sin = rope_tables(spec, torch.arange(config.max_context), device)
        self.style = RopeStyle.INTERLEAVED if spec.rope_interleaved else RopeStyle.NEOX
        d = spec.head_dim
        # decode's input in one kernel: per-head norms or none, full rotation, D a power of 2
        # (a 4-bit pool is written op by op: the fused kernel writes plain and int8 rows)
        self.fused_input = (
            device.type != "cpu" and spec.qk_norm in ("head", "none")
            and self.cos.shape[1] * 2 == d and d & (d - 1) == 0 and config.kv_format != Q4
            and spec.mla is None
        )  # fmt: skip
        self.lens = torch.zeros(1, dtype=torch.int64, device=device)
        # the kernel's scratch, for the largest decode batch (a capture allocates nothing), per
        # KV head of what the cache holds (latent attention: one, its latent)
        self.counts = attention_counts(FUSED_MAX_TOKENS, pool_spec(spec).n_kv_heads, device)
        self.kv_tables: torch.Tensor | None = None  # [B, max_blocks] of this decode pass

    def begin_decode(
        self, pos: torch.Tensor, caches: Sequence[KVCache], tables: torch.Tensor | None = None
    ) -> None:
        """A decode pass at positions pos [B]: each cache's length, once for every layer, and
        the caches' block tables [B, max_blocks] when given (a graph captured per batch size
        fills them), else where the caches are of one pool (one device-side gather: a
        captured graph replays it)."""
        self.lens = pos + 1
        if tables is None and self.batched(caches):
            tables = block_tables(caches, pos.device)
        self.kv_tables = tables

    def batched(self, caches: Sequence[KVCache]) -> bool:
        """Whether a decode step of `caches` runs attention once for all of them: caches of
        one pool, no more than the kernel's scratch holds."""
        return len(caches) <= FUSED_MAX_TOKENS and all(caches[0].same_kind(c) for c in caches)

    def __call__(
        self,
        w: DenseLayer,
        i: int,
        h: torch.Tensor,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        step: Pass,
    ) -> torch.Tensor:
        """Layer i's attention output [T, H] for h [T, H] at positions pos [T]: the qkv and
        output projections over every row of the pass, attention per sequence (a decode
        batch of one pool: in one launch)."""
        spec = self.spec
        qkv = self.linear(h, w.qkv, w.qkv_bias)
        gates = None
        if spec.attn_gate:  # Qwen3-Next: each head's output times the sigmoid of its gate
            qkv, gates = qkv[:, : -spec.q_dim].contiguous(), qkv[:, -spec.q_dim :]
        if step.decode and self.kv_tables is not None:
            out = self._batch(w, i, qkv, pos, caches, self.kv_tables)
        else:
            outs = [
                self._one(w, i, qkv[rows], pos[rows], cache, step, b)
                for b, (rows, cache) in enumerate(zip(step.rows(), caches, strict=True))
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = out.reshape(h.shape[0], -1)
        if gates is not None:
            out = out * torch.sigmoid(gates)
        return self.linear(out, w.o, w.o_bias)

    def _batch(
        self,
        w: DenseLayer,
        i: int,
        qkv: torch.Tensor,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        tables: torch.Tensor,
    ) -> torch.Tensor:
        """A decode batch's attention [B, Hq, D], sequence b's blocks in tables[b] (caches of
        one pool): the fused input and the attention one launch each."""
        spec, bs, pool = self.spec, caches[0].block_size, caches[0].pool
        k, v, (ks, vs) = pool.k[i], pool.v[i], _scales(pool, i)  # the pool's layer i
        if self.fused_input:
            norms = (w.q_norm, w.k_norm) if spec.qk_norm == "head" else None
            q = attn_input(qkv, pos, norms, self.cos, self.sin, k, v, self.style,  # type: ignore[arg-type]
                           spec.rms_eps, block_tables=tables, block_size=bs, k_scale=ks,
                           v_scale=vs)  # fmt: skip
        else:  # the input op by op, each row into its sequence's blocks through the tables
            rows = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
            q = self._decode_query(w, self._input(w, i, qkv, pos, pool, rows))
        out = decode_attention(q, k, v, self.lens, config=self.config, counts=self.counts,
                               block_tables=tables, block_size=bs, k_scale=ks,
                               v_scale=vs, host=pool.host_pages(i), sinks=w.sinks,
                               window=spec.window(i))  # fmt: skip
        return out if w.mla is None else _from_latent(out, w.mla)

    def _one(
        self,
        w: DenseLayer,
        i: int,
        qkv: torch.Tensor,
        pos: torch.Tensor,
        cache: KVCache,
        step: Pass,
        b: int,
    ) -> torch.Tensor:
        """Sequence b's attention [T, Hq, D] (latent attention: [T, H, value_dim]) for its rows
        qkv [T, qkv] at positions pos [T]."""
        spec, bs, (ks, vs) = self.spec, cache.block_size, _scales(cache.pool, i)
        table = cache.table(qkv.device)[None]
        if step.decode and self.fused_input:
            norms = (w.q_norm, w.k_norm) if spec.qk_norm == "head" else None
            q = attn_input(qkv, pos, norms, self.cos, self.sin, cache.k[i], cache.v[i],  # type: ignore[arg-type]
                           self.style, spec.rms_eps, block_tables=table.expand(qkv.shape[0], -1),
                           block_size=bs, k_scale=ks, v_scale=vs)  # fmt: skip
        else:
            q = self._input(w, i, qkv, pos, cache.pool, table[0].long()[pos // bs] * bs + pos % bs)
        if isinstance(step, Decode):  # split-K through the block table
            lens = self.lens[b : b + 1]
            out = decode_attention(self._decode_query(w, q), cache.k[i], cache.v[i], lens,
                                   config=self.config, counts=self.counts, block_tables=table,
                                   block_size=bs, k_scale=ks, v_scale=vs,
                                   host=cache.pool.host_pages(i), sinks=w.sinks,
                                   window=spec.window(i))  # fmt: skip
            return out if w.mla is None else _from_latent(out, w.mla)
        t, start = qkv.shape[0], step.spans[b].start
        keys, values, *scales = cache.gather(i, start + t, qkv.device)
        if scales:  # a prefill chunk attends with torch: floats
            fmt = cache.pool.fmt
            assert isinstance(fmt, Int8KV | Q4KV)
            keys = fmt.dequantize(keys, scales[0]).to(q.dtype)
            values = fmt.dequantize(values, scales[1]).to(q.dtype)
        if w.mla is not None:  # every head's keys and values from the latent rows
            keys, values = _expanded(keys, w.mla, spec.head_dim)
        rep = spec.n_heads // keys.shape[1]
        window = spec.window(i)
        if window:  # gpt-oss's sliding layers: in pieces of rows, each reading its window
            return _attend_rows(q, keys, values, start, w.sinks, window)
        if w.sinks is not None:  # its full layers: the sink as one more key of torch's SDPA
            return sink_attention(q, keys, values, start, w.sinks)
        qh = q.transpose(0, 1)[None]  # [1, Hq, T, D]
        kh = keys.transpose(0, 1).repeat_interleave(rep, 0)[None]
        vh = values.transpose(0, 1).repeat_interleave(rep, 0)[None]
        bias = causal_lower_right(t, start + t)  # causal, aligned to the end of the keys
        out = fn.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)[0].transpose(0, 1)
        return out if w.mla is None else out[..., : spec.value_dim]

    def _decode_query(self, w: DenseLayer, q: torch.Tensor) -> torch.Tensor:
        """A decode step's queries q [T, Hq, D] as its kernel reads them: latent attention's
        in the latent's coordinates (`_absorbed`), else as they are."""
        return q if w.mla is None else _absorbed(q, w.mla, self.spec.head_dim)

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at positions pos [T] by the tables: its first 2 * half dims
        (all of them, or GLM-4.5's partial RoPE), the rest as they are (on a CPU in torch)."""
        if self.device.type == "cpu":
            cos, sin = self.cos[pos], self.sin[pos]
            return apply_rope(x, cos, sin, self.spec.rope_interleaved)
        r = 2 * self.cos.shape[1]
        if r == x.shape[-1]:
            return rope_table(x, pos, self.cos, self.sin, self.style)
        turned = rope_table(x[..., :r].contiguous(), pos, self.cos, self.sin, self.style)
        return torch.cat((turned, x[..., r:]), dim=-1)

    def _input(
        self, w: DenseLayer, i: int, qkv: torch.Tensor, pos: torch.Tensor, pool: KVPool,
        rows: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Rotated q [T, Hq, D] of qkv [T, qkv] at positions pos [T]; k and v written into
        the pool's layer i at `rows` [T] (op by op)."""
        q, k, v = self._latent(w, qkv, pos) if w.mla is not None else self._heads(w, qkv, pos)
        both = pool.v[i] is not pool.k[i]  # else the values are the keys (latent attention's)
        if pool.quantized:  # int8 and a scale per token and KV head, or 4-bit
            fmt = pool.fmt
            assert isinstance(fmt, Int8KV | Q4KV)
            k, k_scale = fmt.quantize(k)
            pool.k_scale[i].index_copy_(0, rows, k_scale)
            if both:
                v, v_scale = fmt.quantize(v)
                pool.v_scale[i].index_copy_(0, rows, v_scale)
        pool.k[i].index_copy_(0, rows, k)
        if both:
            pool.v[i].index_copy_(0, rows, v)
        return q

    def _latent(
        self, w: DenseLayer, qkv: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-head latent attention's rotated q [T, H, D] (its unrotated part, then its
        rotated one, times the spec's score scale, as the reference's `_latent_qkv`) and the
        latent row the cache holds as its key and as its value, k [T, 1, rank + rope]: the
        normed kv latent and the shared rotated key, from qkv [T, q's input + kv_a]
        (`stratad.model.graph.mla`). Decode attends over the rows in the latent's coordinates
        (`_absorbed`), a prefill chunk over every head's keys and values expanded from them
        (`_expanded`)."""
        spec, m, t = self.spec, w.mla, qkv.shape[0]
        assert m is not None and spec.mla is not None
        heads, d, rot, eps = spec.n_heads, spec.head_dim, spec.mla.rope_dim, spec.rms_eps
        nope, rank = d - rot, spec.mla.kv_lora_rank
        q_in, kv_a = qkv.split([m.q_in, qkv.shape[1] - m.q_in], dim=-1)
        if m.q_b is not None and m.q_a_norm is not None:
            q_in = self.linear(self.norm(q_in.contiguous(), m.q_a_norm, eps), m.q_b, None)
        q = q_in.reshape(t, heads, d)
        latent, k_rot = kv_a.split([rank, rot], dim=-1)
        latent = self.norm(latent.contiguous(), m.kv_a_norm, eps)
        q_rot = self._rotate(q[..., nope:].contiguous(), pos)
        k_rot = self._rotate(k_rot.reshape(t, 1, rot).contiguous(), pos)
        q = torch.cat((q[..., :nope], q_rot), dim=-1)
        if spec.attn_scale != 1.0:
            q = q * spec.attn_scale
        k = torch.cat((latent.reshape(t, 1, rank), k_rot.to(latent.dtype)), dim=-1)
        return q, k, k

    def _heads(
        self, w: DenseLayer, qkv: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated q [T, Hq, D], k and v [T, Hkv, D] of qkv [T, q + k + v] (its norms)."""
        spec, t = self.spec, qkv.shape[0]
        q, k, v = qkv.split([spec.q_dim, spec.kv_dim, spec.kv_dim], dim=-1)
        norm = self.norm
        if spec.qk_norm == "full":
            q, k = norm(q, w.q_norm, spec.rms_eps), norm(k, w.k_norm, spec.rms_eps)  # type: ignore[arg-type]
        q = q.reshape(t, spec.n_heads, spec.head_dim)
        k = k.reshape(t, spec.n_kv_heads, spec.head_dim)
        v = v.reshape(t, spec.n_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":
            q, k = norm(q, w.q_norm, spec.rms_eps), norm(k, w.k_norm, spec.rms_eps)  # type: ignore[arg-type]
        return self._rotate(q, pos), self._rotate(k, pos), v


def _absorbed(q: torch.Tensor, m: MlaLayer, d: int) -> torch.Tensor:
    """Latent attention's queries q [T, H, d] (unrotated part, rotated part) in the cached
    latent's coordinates [T, H, rank + rope]: each head's unrotated part through its key
    expansion (q k_b: q . (k_b c) = (q k_b) . c), scaled so that the kernel's
    1/sqrt(rank + rope) gives the scores' 1/sqrt(d)."""
    nope, rank = m.k_b.shape[1], m.k_b.shape[2]
    lat = torch.bmm(q[..., :nope].transpose(0, 1).to(m.k_b.dtype), m.k_b)  # [H, T, rank]
    out = torch.cat((lat.transpose(0, 1), q[..., nope:].to(lat.dtype)), dim=-1)
    return out * ((rank + d - nope) / d) ** 0.5


def _from_latent(out: torch.Tensor, m: MlaLayer) -> torch.Tensor:
    """Latent attention's decode output [T, H, rank + rope] (its values are the cached latent
    rows) as each head's value [T, H, value_dim]: the latent part through the head's v_b."""
    rank = m.v_b.shape[-1]
    lat = out[..., :rank].transpose(0, 1).to(m.v_b.dtype)  # [H, T, rank]
    return torch.bmm(lat, m.v_b.transpose(1, 2)).transpose(0, 1)  # [H, T, v] -> [T, H, v]


def _expanded(rows: torch.Tensor, m: MlaLayer, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's keys [S, H, d] and values [S, H, d] (widened with zeros from value_dim,
    for attention kernels that want one width) from the cached latent rows [S, 1, rank +
    rope]: a prefill chunk attends with heads of d dims, not of the latent's (DeepSeek's 576
    are past the fused attention kernels' widths)."""
    heads, nope, rank = m.k_b.shape
    c, k_rot = rows[:, 0].split([rank, rows.shape[-1] - rank], dim=-1)
    c = c.to(m.k_b.dtype)
    k_nope = torch.einsum("sr,hnr->shn", c, m.k_b)
    values = torch.einsum("sr,hvr->shv", c, m.v_b)
    keys = torch.cat((k_nope, k_rot[:, None].to(c.dtype).expand(-1, heads, -1)), dim=-1)
    return keys, fn.pad(values, (0, d - values.shape[-1]))


# query rows per piece of a sliding layer's prefill chunk: each piece reads its rows' window
# of keys (rows + window - 1), its scores [Hq, rows, keys] at a time (64 heads, a window of 128:
# 40 MB in half precision)
_ROWS = 512


def _attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
    sinks: torch.Tensor | None, window: int,
) -> torch.Tensor:  # fmt: skip
    """A prefill chunk's attention [T, Hq, D] for queries q [T, Hq, D] at positions start..,
    over keys/values [start + T, Hkv, D], with gpt-oss's sinks [Hq] and `window` (0: none):
    over pieces of _ROWS queries, each reading the keys it can see (with sinks through torch's
    fused attention, `sink_attention`; else the reference's product)."""
    outs = []
    attend = attention if sinks is None else sink_attention
    for r0 in range(0, q.shape[0], _ROWS):
        r1 = min(r0 + _ROWS, q.shape[0])
        first = max(0, start + r0 - window + 1) if window else 0  # the piece's oldest key
        outs.append(attend(q[r0:r1], keys[first : start + r1], values[first : start + r1],
                           start + r0 - first, sinks, window))  # type: ignore[arg-type]  # fmt: skip
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, sinks: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:  # fmt: skip
    """A prefill chunk's causal attention [T, Hq, D] for queries q [T, Hq, D] at positions
    start.. over keys/values [start + T, Hkv, D] (`window`: each query sees itself and the
    window - 1 keys before it; 0: all), each head's sink logit (float32 [Hq]) joining
    its softmax, through torch's fused attention: the sink is one more key whose score is the
    sink for every query. The heads widen by two dims (the queries' 1s, the sink key's sink /
    the scale split into a high part and the rest, so that half precision keeps it to 2^-16;
    every other key's 0s), padded to a multiple of 8; the sink's value is zero."""
    t, hq, d = q.shape
    s, hkv = keys.shape[0], keys.shape[1]
    wide, scale = -(-(d + 2) // 8) * 8, d**-0.5
    qh = q.new_zeros(1, hq, t, wide)
    qh[0, :, :, :d] = q.transpose(0, 1)
    qh[0, :, :, d : d + 2] = 1.0
    kh = keys.new_zeros(1, hq, s + 1, wide)
    kh[0, :, :s, :d] = keys.transpose(0, 1).repeat_interleave(hq // hkv, 0)
    logit = sinks.float() / scale
    high = logit.to(keys.dtype)
    kh[0, :, s, d], kh[0, :, s, d + 1] = high, (logit - high.float()).to(keys.dtype)
    vh = values.new_zeros(1, hq, s + 1, d)
    vh[0, :, :s] = values.transpose(0, 1).repeat_interleave(hq // hkv, 0)
    qpos = torch.arange(start, start + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    seen = torch.ones(t, s + 1, dtype=torch.bool, device=q.device)
    seen[:, :s] = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    out = fn.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=scale)
    return out[0].transpose(0, 1)


def _scales(pool: KVPool, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Layer i's (k, v) scales of an int8 `pool`, the attention kernels' `k_scale` and
    `v_scale` (None, None: plain KV)."""
    if not pool.quantized:
        return None, None
    return pool.k_scale[i], pool.v_scale[i]
