"""A stack of dense layers in one kernel call (kernels/cpu/dense.py, kernels/cpu/dense.h)
against the torch layers (stratad/engine/reference/layers.py) on small shapes, and the team size
chosen by measurement (kernels/cpu/team.py).

The reference rounds each product's input as the kernels do (`q8`, int8 per block of 32; not
for float weights, whose products take the floats) and computes in float32 with torch's
order of sums: what is left is summation order, and now and then a rounding step that a
last-bit difference moved (a small multiple of the step, hence the tolerances)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kernels.cpu.dense import (
    CACHE_DTYPE,
    PROJECTIONS,
    CacheSpan,
    DenseLayer,
    DenseShape,
    DenseStack,
)
from kernels.cpu.experts import CpuExperts
from kernels.cpu.team import PROBE_EVERY, PROBE_MAX_TOKENS, TeamSize
from kernels.formats.quant import QType
from stratad.engine.kv_format import Q4KV, Int8KV
from stratad.engine.reference.layers import apply_rope, rms_norm, rope_tables
from stratad.model.spec import ModelSpec
from tests.test_cpu_experts import blocks, dense, q8

SHAPE = DenseShape(hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=96,
                   rope_interleaved=True, eps=1e-5)  # fmt: skip
TOL = {QType.F32: 1e-4, QType.Q8_0: 2e-2, QType.Q4_1: 2e-2}  # of the largest |x|


# native: the AVX2 paths where the host has them; portable: the plain C ones
@pytest.fixture(scope="module", params=["native", "portable"])
def kernels(request: pytest.FixtureRequest) -> CpuExperts:
    return CpuExperts(threads=2, native=request.param == "native")


def _layers(
    qtype: QType, n: int, bias: bool, shape: DenseShape = SHAPE
) -> tuple[list[DenseLayer], list[dict[str, torch.Tensor]]]:
    """n layers of random weights in `qtype`, and their float values for the reference."""
    gen = torch.Generator().manual_seed(7)
    layers, floats = [], []
    for i in range(n):
        ws, f = [], {}
        for j, name in enumerate(PROJECTIONS):
            rows, cols = shape.rows_cols()[name]
            raw = blocks(qtype, rows, cols, seed=100 * i + j)
            ws.append((raw.view(torch.float32) if qtype == QType.F32 else raw, qtype))
            f[name] = dense(raw, qtype, rows, cols).float()
        for name in ("attn_norm", "ffn_norm"):
            f[name] = 1 + 0.1 * torch.randn(shape.hidden, generator=gen)
        biases = [None, None, None] if not bias else [
            0.1 * torch.randn(shape.rows_cols()[p][0], generator=gen) for p in ("q", "k", "v")
        ]  # fmt: skip
        f.update({f"{p}_bias": b for p, b in zip("qkv", biases, strict=True) if b is not None})
        layers.append(DenseLayer(f["attn_norm"], f["ffn_norm"], tuple(ws),
                                 (biases[0], biases[1], biases[2])))  # fmt: skip
        floats.append(f)
    return layers, floats


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """`layers.attention_by_row` with llama.cpp's halves: the cache's k and v [S, Hkv, D], q
    and the probabilities rounded to halves for their products."""
    rep, rows = q.shape[1] // k.shape[1], []
    for i in range(q.shape[0]):
        kk, vv = (c[: start + i + 1].float().repeat_interleave(rep, 1).transpose(0, 1)
                  for c in (k, v))  # fmt: skip
        scores = (kk @ q[i].half().float()[:, :, None])[..., 0] / q.shape[-1] ** 0.5
        rows.append((scores.softmax(-1).half().float()[:, None, :] @ vv)[:, 0])
    return torch.stack(rows)


def _reference(x, floats, kc, vc, start, cos, sin, qtype, s=SHAPE,  # type: ignore[no-untyped-def]
               store=lambda c: c):  # fmt: skip
    """The torch forward's layers (forward.ReferenceForward) with the kernels' roundings;
    `store`: what the cache gives back of the keys and values written."""
    t = x.shape[0]
    r = (lambda v: v) if qtype == QType.F32 else q8
    for i, f in enumerate(floats):
        h = r(rms_norm(x, f["attn_norm"], s.eps))
        q, k, v = (h @ f[p].T + f.get(f"{p}_bias", 0) for p in "qkv")
        q = apply_rope(q.view(t, s.n_heads, s.head_dim), cos, sin, s.rope_interleaved)
        k = apply_rope(k.view(t, s.n_kv_heads, s.head_dim), cos, sin, s.rope_interleaved)
        kc[i][start : start + t], vc[i][start : start + t] = store(k), store(v.view(k.shape))
        att = _attention(q, kc[i][: start + t], vc[i][: start + t], start)
        x = x + r(att.reshape(t, -1)) @ f["o"].T
        h = r(rms_norm(x, f["ffn_norm"], s.eps))
        x = x + r(torch.nn.functional.silu(h @ f["gate"].T) * (h @ f["up"].T)) @ f["down"].T
    return x


Inputs = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]


def _inputs(t: int, start: int, n: int, s: DenseShape = SHAPE) -> Inputs:
    """x [t, H], n layers' k and v caches holding `start` earlier positions, RoPE's tables."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, s.hidden, generator=gen)
    cache = [torch.randn(start + t + 2, s.n_kv_heads, s.head_dim, generator=gen).half()
             for _ in range(2 * n)]  # fmt: skip
    spec = ModelSpec(arch="llama", n_layers=n, hidden=s.hidden, n_heads=s.n_heads,
                     n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, vocab_size=32,
                     rms_eps=s.eps, rope_theta=10_000.0, context_length=64)  # fmt: skip
    cos, sin = rope_tables(spec, torch.arange(start, start + t), torch.device("cpu"))
    return x, cache[:n], cache[n:], cos, sin


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0, QType.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize(("t", "start", "bias"), [(1, 0, False), (5, 3, True), (20, 0, False)])
def test_dense_stack_matches_torch(kernels: CpuExperts, qtype: QType, t: int, start: int,
                                   bias: bool) -> None:  # fmt: skip
    layers, floats = _layers(qtype, 2, bias)
    stack = DenseStack(kernels, SHAPE, layers)
    x, kc, vc, cos, sin = _inputs(t, start, 2)
    ref_kc, ref_vc = [c.clone() for c in kc], [c.clone() for c in vc]
    want = _reference(x.clone(), floats, ref_kc, ref_vc, start, cos, sin, qtype)
    stack(x, [CacheSpan(kc, vc, start, t)], cos, sin)
    tol = TOL[qtype] * want.abs().max()
    assert (x - want).abs().max() <= tol
    for got_c, want_c in zip(kc + vc, ref_kc + ref_vc, strict=True):
        got_c, want_c = got_c.float(), want_c.float()  # halves: a last-bit difference is 1e-3
        assert (got_c - want_c).abs().max() <= max(TOL[qtype], 2e-3) * want_c.abs().max()


def test_chunks_and_threads_give_the_same_bits(kernels: CpuExperts) -> None:
    layers, _ = _layers(QType.Q4_1, 2, bias=True)
    x, kc, vc, cos, sin = _inputs(7, 0, 2)
    whole = x.clone()
    DenseStack(kernels, SHAPE, layers)(whole, [CacheSpan(kc, vc, 0, 7)], cos, sin)
    one = DenseStack(CpuExperts(threads=1, native=kernels.native), SHAPE, layers)
    parts = [x[:3].clone(), x[3:].clone()]
    one(parts[0], [CacheSpan(kc, vc, 0, 3)], cos[:3].contiguous(), sin[:3].contiguous())
    one(parts[1], [CacheSpan(kc, vc, 3, 4)], cos[3:].contiguous(), sin[3:].contiguous())
    assert torch.equal(torch.cat(parts), whole)


def test_a_window_of_tokens_gives_each_token_its_bits_alone(kernels: CpuExperts) -> None:
    # a verify window (9 tokens after 37 cached: their keys end inside groups of eight, and
    # 18 queries per KV head make two parts) attended together gives each token the bits it
    # gets alone; rows past the window are NaN, so a read past the last key shows
    layers, _ = _layers(QType.Q4_1, 2, bias=True)
    x, kc, vc, cos, sin = _inputs(9, 37, 2)
    for c in kc + vc:
        c[46:] = float("nan")
    whole, wk, wv = x.clone(), [c.clone() for c in kc], [c.clone() for c in vc]
    DenseStack(kernels, SHAPE, layers)(whole, [CacheSpan(wk, wv, 37, 9)], cos, sin)
    one = DenseStack(CpuExperts(threads=1, native=kernels.native), SHAPE, layers)
    for t in range(9):
        row = x[t : t + 1]  # a view: each token's row is computed in place
        one(row, [CacheSpan(kc, vc, 37 + t, 1)], cos[t : t + 1].contiguous(),
            sin[t : t + 1].contiguous())  # fmt: skip
    assert not whole.isnan().any()
    assert torch.equal(x, whole)
    assert all(torch.equal(g[:46], w[:46]) for g, w in zip(kc + vc, wk + wv, strict=True))


def test_the_query_heads_of_a_kv_head_in_any_parts(kernels: CpuExperts) -> None:
    # ten query heads on one KV head: attended in parts of at most sixteen queries, as many
    # parts as keep the team busy (two on one thread, eight on four); each head's sums are the same
    # whatever part holds it, over keys past the prefetch distance
    wide = DenseShape(hidden=128, n_heads=10, n_kv_heads=1, head_dim=32, ffn=96,
                      rope_interleaved=False, eps=1e-5)  # fmt: skip
    layers, floats = _layers(QType.Q8_0, 1, False, wide)
    x, kc, vc, cos, sin = _inputs(1, 40, 1, wide)
    want = _reference(x.clone(), floats, [c.clone() for c in kc], [c.clone() for c in vc], 40,
                      cos, sin, QType.Q8_0, wide)  # fmt: skip
    got = []
    for threads in (1, 4):
        y, k, v = x.clone(), [c.clone() for c in kc], [c.clone() for c in vc]
        DenseStack(CpuExperts(threads, native=kernels.native), wide, layers)(
            y, [CacheSpan(k, v, 40, 1)], cos, sin)
        got.append(y)
    assert torch.equal(got[0], got[1])
    assert (got[0] - want).abs().max() <= TOL[QType.Q8_0] * want.abs().max()


@pytest.mark.parametrize("fmt", [Int8KV(), Q4KV()], ids=lambda f: f.name)
def test_quantized_caches_as_their_format_stores_them(kernels: CpuExperts,
                                                      fmt: Int8KV | Q4KV) -> None:  # fmt: skip
    # int8 keys and values with a scale per row and KV head, or 4-bit codes with a half scale
    # and minimum per 32 values: the new rows written as the format's torch definition
    # writes them, every row read as it gives them back
    layers, floats = _layers(QType.Q8_0, 2, bias=True)
    x, kc, vc, cos, sin = _inputs(5, 3, 2)
    k8, v8 = [fmt.quantize(c.float()) for c in kc], [fmt.quantize(c.float()) for c in vc]
    ref_k, ref_v = [fmt.dequantize(*a) for a in k8], [fmt.dequantize(*a) for a in v8]
    want = _reference(x.clone(), floats, ref_k, ref_v, 3, cos, sin, QType.Q8_0,
                      store=fmt.round_trip)  # fmt: skip
    before = [q[:3].clone() for q, _ in k8]
    DenseStack(kernels, SHAPE, layers)(x, [CacheSpan(
        [q for q, _ in k8], [q for q, _ in v8], 3, 5,
        k_scale=[s for _, s in k8], v_scale=[s for _, s in v8])], cos, sin)  # fmt: skip
    assert (x - want).abs().max() <= TOL[QType.Q8_0] * want.abs().max()
    for (q, sc), ref, old in zip(k8, ref_k, before, strict=True):
        assert torch.equal(q[:3], old)  # the earlier rows as they were
        got = fmt.dequantize(q[3:8], sc[3:8])
        assert (got - ref[3:8]).abs().max() <= TOL[QType.Q8_0] * ref[3:8].abs().max()
    with pytest.raises(ValueError, match="scales"):  # scales for some spans only
        DenseStack(kernels, SHAPE, layers)(x[:1].clone(), [CacheSpan(
            [q for q, _ in k8], [q for q, _ in v8], 3, 1, k_scale=[s for _, s in k8])],
            cos[:1].contiguous(), sin[:1].contiguous())  # fmt: skip


def test_a_batch_gives_each_sequence_its_bits_alone(kernels: CpuExperts) -> None:
    # three sequences in one call (a prompt chunk after 2 cached tokens, a decode token at 5,
    # a first prompt chunk) against each alone: the same hidden rows and caches, bit for bit
    layers, _ = _layers(QType.Q4_1, 2, bias=True)
    stack = DenseStack(kernels, SHAPE, layers)
    spans = [(2, 4), (5, 1), (0, 3)]
    inputs = [_inputs(t, start, 2) for start, t in spans]
    alone = []
    for (start, t), (x, kc, vc, cos, sin) in zip(spans, inputs, strict=True):
        kc, vc, x = [c.clone() for c in kc], [c.clone() for c in vc], x.clone()
        stack(x, [CacheSpan(kc, vc, start, t)], cos, sin)
        alone.append((x, kc, vc))
    x = torch.cat([i[0] for i in inputs])
    cos, sin = (torch.cat([i[k] for i in inputs]) for k in (3, 4))
    stack(x, [CacheSpan(i[1], i[2], start, t) for (start, t), i in zip(spans, inputs, strict=True)],
          cos, sin)  # fmt: skip
    assert torch.equal(x, torch.cat([a[0] for a in alone]))
    for i, a in zip(inputs, alone, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(i[1] + i[2], a[1] + a[2], strict=True))


Table = np.ndarray | torch.Tensor


def pool_rows(table: Table, block_size: int, n: int) -> torch.Tensor:
    """The pool's rows of positions 0 .. n - 1 of the sequence whose blocks `table` holds."""
    p = torch.arange(n)
    return torch.as_tensor(table).long()[p // block_size] * block_size + p % block_size


def paged(
    caches: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]],
    spans: Sequence[tuple[int, int]],
    block_size: int,
    seed: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Table]]:
    """A pool of KV blocks for the spans (start, length), each with its caches' (k, v per
    layer) first `start` positions in its blocks; the blocks in a random order among spare
    ones, every other row NaN (a stray read shows); each span's table, in the forms the
    engine may hand: int32 numpy, an int32 tensor, int64 with unread entries past its end."""
    need = [-(-(start + t) // block_size) for start, t in spans]
    n_blocks = sum(need) + 3
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    ids = order[: sum(need)].to(torch.int32).split(need)
    forms = (lambda t: t.numpy(), lambda t: t.clone(),
             lambda t: np.append(t.numpy().astype(np.int64), [-1, n_blocks]))  # fmt: skip
    tables = [forms[i % 3](t) for i, t in enumerate(ids)]
    shape = (n_blocks * block_size, *caches[0][0][0].shape[1:])
    pool_k, pool_v = ([torch.full(shape, float("nan"), dtype=CACHE_DTYPE) for _ in caches[0][0]]
                      for _ in "kv")  # fmt: skip
    for (kc, vc), (start, _), table in zip(caches, spans, tables, strict=True):
        r = pool_rows(table, block_size, start)
        for pool, c in zip(pool_k + pool_v, kc + vc, strict=True):
            pool[r] = c[:start]
    return pool_k, pool_v, tables


@pytest.mark.parametrize("block_size", [8, 16])
def test_a_paged_cache_gives_the_bits_of_a_contiguous_one(
    kernels: CpuExperts, block_size: int
) -> None:
    # a prompt chunk across a block boundary after 5 cached tokens, a decode token over 38
    # keys (blocks in a random order), a first prompt ending inside a block: the hidden rows
    # and the keys and values (read through the tables) of the same call over contiguous caches
    layers, _ = _layers(QType.Q4_1, 2, bias=True)
    stack = DenseStack(kernels, SHAPE, layers)
    spans = [(5, 6), (37, 1), (0, 11)]
    inputs = [_inputs(t, start, 2) for start, t in spans]
    pool_k, pool_v, tables = paged([i[1:3] for i in inputs], spans, block_size, seed=5)
    x = torch.cat([i[0] for i in inputs])
    cos, sin = (torch.cat([i[k] for i in inputs]) for k in (3, 4))
    want = x.clone()
    stack(want, [CacheSpan(i[1], i[2], start, t) for (start, t), i in zip(spans, inputs,
                                                                         strict=True)],
          cos, sin)  # fmt: skip
    stack(x, [CacheSpan(pool_k, pool_v, start, t, table, block_size)
              for (start, t), table in zip(spans, tables, strict=True)], cos, sin)  # fmt: skip
    assert torch.equal(x, want)
    for (start, t), i, table in zip(spans, inputs, tables, strict=True):
        r = pool_rows(table, block_size, start + t)
        for pool, c in zip(pool_k + pool_v, i[1] + i[2], strict=True):
            assert torch.equal(pool[r], c[: start + t])


def test_bad_block_tables_are_refused(kernels: CpuExperts) -> None:
    layers, _ = _layers(QType.Q8_0, 1, bias=False)
    stack = DenseStack(kernels, SHAPE, layers)
    x, kc, vc, cos, sin = _inputs(2, 0, 1)
    pk, pv = ([torch.zeros(4 * 8, SHAPE.n_kv_heads, SHAPE.head_dim, dtype=CACHE_DTYPE)]
              for _ in "kv")  # fmt: skip
    ids = np.array([2, 0], dtype=np.int32)

    def call(*spans: CacheSpan) -> None:
        stack(x, list(spans), cos, sin)

    call(CacheSpan(pk, pv, 8, 1, ids, 8), CacheSpan(pk, pv, 8, 1, np.array([2, 1]), 8))
    # ^ block 2 only read by both (a common prefix): allowed
    for size in (4, 12):
        with pytest.raises(ValueError, match="power of two"):
            call(CacheSpan(pk, pv, 0, 2, ids, size))
    with pytest.raises(ValueError, match="without a table"):
        call(CacheSpan(kc, vc, 0, 2, block_size=8))
    with pytest.raises(ValueError, match="1-D integers"):
        call(CacheSpan(pk, pv, 0, 2, ids.astype(np.float32), 8))
    with pytest.raises(ValueError, match="1-D integers"):
        call(CacheSpan(pk, pv, 0, 2, torch.tensor([[2]], dtype=torch.int32), 8))
    with pytest.raises(ValueError, match="2 blocks of 8 cannot hold 17 positions"):
        call(CacheSpan(pk, pv, 15, 2, ids, 8))
    with pytest.raises(ValueError, match="outside the pool's 4 blocks"):
        call(CacheSpan(pk, pv, 0, 2, np.array([4], dtype=np.int32), 8))
    with pytest.raises(ValueError, match="outside the pool's 4 blocks"):
        call(CacheSpan(pk, pv, 8, 2, np.array([-1, 0], dtype=np.int32), 8))
    with pytest.raises(ValueError, match="not whole blocks of 8"):
        call(CacheSpan([pk[0][:28]], [pv[0][:28]], 0, 2, ids, 8))
    with pytest.raises(ValueError, match="block 0 is written by a span"):
        call(CacheSpan(pk, pv, 8, 1, ids, 8), CacheSpan(pk, pv, 0, 1, np.array([0]), 8))
    with pytest.raises(ValueError, match="block 1 is written by a span"):  # two of one table
        call(CacheSpan(pk, pv, 14, 2, np.array([1, 1], dtype=np.int32), 8))
    with pytest.raises(ValueError, match="share a cache"):  # a pool is no span's own cache
        call(CacheSpan(pk, pv, 0, 1, ids, 8), CacheSpan(pk, pv, 0, 1))
    with pytest.raises(ValueError, match="share a cache"):  # k and v one tensor
        call(CacheSpan(pk, pk, 0, 2, ids, 8))


def test_bad_inputs_are_refused(kernels: CpuExperts) -> None:
    layers, _ = _layers(QType.Q8_0, 1, bias=False)
    stack = DenseStack(kernels, SHAPE, layers)
    x, kc, vc, cos, sin = _inputs(2, 0, 1)
    with pytest.raises(ValueError, match="x must be"):
        stack(x[:, :64].contiguous(), [CacheSpan(kc, vc, 0, 2)], cos, sin)
    with pytest.raises(ValueError, match="cannot hold"):
        stack(x, [CacheSpan(kc, vc, 3, 2)], cos, sin)
    with pytest.raises(ValueError, match="cache layers"):
        stack(x, [CacheSpan(kc + kc, vc, 0, 2)], cos, sin)
    with pytest.raises(ValueError, match="spans hold 3 tokens, x 2"):
        stack(x, [CacheSpan(kc, vc, 0, 3)], cos, sin)
    with pytest.raises(ValueError, match="share a cache"):
        stack(x, [CacheSpan(kc, vc, 0, 1), CacheSpan(kc, vc, 1, 1)], cos, sin)
    bad = DenseLayer(layers[0].attn_norm, layers[0].ffn_norm, layers[0].weights[1:] * 2,
                     layers[0].biases)  # fmt: skip
    with pytest.raises(ValueError, match="holds"):
        DenseStack(kernels, SHAPE, [bad])


def test_team_size_follows_the_faster() -> None:
    team = TeamSize(2)
    seconds = {1: 1.0, 2: 3.0}  # a busy host: one thread is faster
    picks = []
    for _ in range(8 * PROBE_EVERY):
        n = team.pick(1)
        picks.append(n)
        team.record(1, n, seconds[n])
    assert picks[:3] == [2, 1, 2] and picks[-1] == 1  # all threads first, then measured
    # the other size tried now and then, three times as seldom as it is slower
    assert 2 <= picks[3:].count(2) <= 3
    seconds = {1: 1.0, 2: 0.4}  # the cores free again: back within a few tries
    for _ in range(12 * PROBE_EVERY):
        n = team.pick(1)
        team.record(1, n, seconds[n])
    assert team.pick(1) == 2 and TeamSize(1).sizes == [1]


def test_a_prompt_chunk_runs_on_the_whole_team_untried() -> None:
    """A call of more than PROBE_MAX_TOKENS tokens is not measured: the second prompt of a
    length ran on one thread before, at half its speed on an idle host."""
    team = TeamSize(2)
    picks = []
    for _ in range(3):
        picks.append(team.pick(PROBE_MAX_TOKENS + 1))
        team.record(PROBE_MAX_TOKENS + 1, picks[-1], 1.0)
    assert picks == [2, 2, 2]
    assert [team.pick(PROBE_MAX_TOKENS) for _ in range(2)] == [2, 1]  # a decode-sized one is
