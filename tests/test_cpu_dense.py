"""A stack of dense layers in one kernel call (kernels/cpu/dense.py, kernels/cpu/dense.h)
against the torch layers (stratad/engine/reference/layers.py) on small shapes, and the team size
chosen by measurement (kernels/cpu/team.py).

The reference rounds each product's input as the kernels do (`q8`, int8 per block of 32; not
for float weights, whose products take the floats) and computes in float32 with torch's
order of sums: what is left is summation order, and now and then a rounding step that a
last-bit difference moved (a small multiple of the step, hence the tolerances)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.dense import PROJECTIONS, CacheSpan, DenseLayer, DenseShape, DenseStack
from kernels.cpu.experts import CpuExperts
from kernels.cpu.team import PROBE_EVERY, PROBE_MAX_TOKENS, TeamSize
from kernels.formats.quant import QType
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
    qtype: QType, n: int, bias: bool
) -> tuple[list[DenseLayer], list[dict[str, torch.Tensor]]]:
    """n layers of random weights in `qtype`, and their float values for the reference."""
    gen = torch.Generator().manual_seed(7)
    layers, floats = [], []
    for i in range(n):
        ws, f = [], {}
        for j, name in enumerate(PROJECTIONS):
            rows, cols = SHAPE.rows_cols()[name]
            raw = blocks(qtype, rows, cols, seed=100 * i + j)
            ws.append((raw.view(torch.float32) if qtype == QType.F32 else raw, qtype))
            f[name] = dense(raw, qtype, rows, cols).float()
        for name in ("attn_norm", "ffn_norm"):
            f[name] = 1 + 0.1 * torch.randn(SHAPE.hidden, generator=gen)
        biases = [None, None, None] if not bias else [
            0.1 * torch.randn(SHAPE.rows_cols()[p][0], generator=gen) for p in ("q", "k", "v")
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


def _reference(x, floats, kc, vc, start, cos, sin, qtype):  # type: ignore[no-untyped-def]
    """The torch forward's layers (forward.ReferenceForward) with the kernels' roundings."""
    s, t = SHAPE, x.shape[0]
    r = (lambda v: v) if qtype == QType.F32 else q8
    for i, f in enumerate(floats):
        h = r(rms_norm(x, f["attn_norm"], s.eps))
        q, k, v = (h @ f[p].T + f.get(f"{p}_bias", 0) for p in "qkv")
        q = apply_rope(q.view(t, s.n_heads, s.head_dim), cos, sin, s.rope_interleaved)
        k = apply_rope(k.view(t, s.n_kv_heads, s.head_dim), cos, sin, s.rope_interleaved)
        kc[i][start : start + t], vc[i][start : start + t] = k, v.view(k.shape)
        att = _attention(q, kc[i][: start + t], vc[i][: start + t], start)
        x = x + r(att.reshape(t, -1)) @ f["o"].T
        h = r(rms_norm(x, f["ffn_norm"], s.eps))
        x = x + r(torch.nn.functional.silu(h @ f["gate"].T) * (h @ f["up"].T)) @ f["down"].T
    return x


Inputs = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]


def _inputs(t: int, start: int, n: int) -> Inputs:
    """x [t, H], n layers' k and v caches holding `start` earlier positions, RoPE's tables."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, SHAPE.hidden, generator=gen)
    cache = [torch.randn(start + t + 2, SHAPE.n_kv_heads, SHAPE.head_dim, generator=gen).half()
             for _ in range(2 * n)]  # fmt: skip
    spec = ModelSpec(arch="llama", n_layers=n, hidden=SHAPE.hidden, n_heads=SHAPE.n_heads,
                     n_kv_heads=SHAPE.n_kv_heads, head_dim=SHAPE.head_dim, vocab_size=32,
                     rms_eps=SHAPE.eps, rope_theta=10_000.0, context_length=64)  # fmt: skip
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
