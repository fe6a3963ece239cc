"""A MoE model's layers in one kernel call (kernels/cpu/moe_stack.py, kernels/cpu/moe_layers.h)
against the cpu engine's layer-by-layer path (the torch layers of
stratad/engine/reference/forward.py, each product one kernel call:
`QuantWeights(one_call=False)`), on the synthetic tiny MoE (Qwen3-MoE's layers: per-head q/k
norms, softmax top-k routing).

The two differ only where the one call keeps keys and values in halves (as llama.cpp does, the
per-projection path in float32) and sums in its own order: logits close, the same greedy tokens
and the same routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu.dense import CacheSpan
from kernels.cpu.experts import CpuExperts
from kernels.cpu.moe_stack import MoEStack
from kernels.formats.quant import QType
from stratad.engine.batch import Output, Seq
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.layers import rope_tables
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.model.synthetic.writer import PRESETS, write_synth
from stratad.store.loader import load_model
from tests.test_cpu_dense import paged, pool_rows

TOL = 0.5  # logits (0.21 seen, of logits up to 18)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Q8_0 attention as the a3b's (test_cpu_engine's tiny MoE has F16)."""
    preset = dataclasses.replace(PRESETS["tiny-moe"], attn_qtype=QType.Q8_0)
    path = tmp_path_factory.mktemp("moe-stack") / "tiny-moe.gguf"
    write_synth(preset, path)
    return load_model(path)


@pytest.fixture(scope="module")
def kernels() -> CpuExperts:
    return CpuExperts(threads=2)


def _run(forward: ReferenceForward, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after the prompt, and every position's logits."""
    cache = forward.new_cache(len(prompt) + n + 1)
    logits = [forward(prompt, cache, all_logits=True)]
    out = []
    for _ in range(n):
        out.append(int(logits[-1][-1].argmax()))
        logits.append(forward([out[-1]], cache))
    return out, torch.cat(logits)


def test_one_call_matches_the_layer_by_layer_path(tiny_moe: Model, kernels: CpuExperts) -> None:
    fast = ReferenceForward(tiny_moe, weights=QuantWeights(kernels))
    slow = ReferenceForward(tiny_moe, weights=QuantWeights(kernels, one_call=False))
    assert isinstance(fast.stack, MoEStack) and slow.stack is None
    prompt = list(range(3, 19))
    got, got_logits = _run(fast, prompt, 6)
    want, want_logits = _run(slow, prompt, 6)
    assert got == want
    assert (got_logits - want_logits).abs().max() < TOL
    assert torch.equal(fast.route_counts, slow.route_counts)
    assert int(fast.route_counts.sum()) == 4 * 2 * (len(prompt) + 6)  # layers x top-k x tokens


def test_chunks_and_threads_give_the_same_bits(tiny_moe: Model, kernels: CpuExperts) -> None:
    """A prompt in one call, or in two on one thread: the same logits to the bit."""
    prompt = list(range(40, 61))
    fast = ReferenceForward(tiny_moe, weights=QuantWeights(kernels))
    whole = fast(prompt, fast.new_cache(32))[-1]
    one = ReferenceForward(tiny_moe, weights=QuantWeights(CpuExperts(threads=1)))
    cache = one.new_cache(32)
    one(prompt[:9], cache)
    assert torch.equal(one(prompt[9:], cache)[-1], whole)


def test_a_batch_gives_each_sequence_its_bits_alone(tiny_moe: Model, kernels: CpuExperts) -> None:
    """`step` over three sequences (a decode token after a prompt, a second prompt chunk whose
    final-norm hidden states are asked for, a first prompt whose every logit is asked for) in
    one call: each sequence's rows and cache the bits of it alone, and the same routing
    counts."""
    fast = ReferenceForward(tiny_moe, weights=QuantWeights(kernels))
    alone = ReferenceForward(tiny_moe, weights=QuantWeights(kernels))
    firsts = [list(range(5, 12)), list(range(30, 34)), []]
    nexts = [[9], list(range(50, 56)), list(range(60, 65))]
    caches = {f: [f.new_cache(16) for _ in firsts] for f in (fast, alone)}
    for f in (fast, alone):
        for c, tokens in zip(caches[f], firsts, strict=True):
            if tokens:
                f(tokens, c)
    outs = [Output.NEXT, Output.HIDDEN, Output.LOGITS]
    got = fast.step([Seq(*a) for a in zip(caches[fast], nexts, outs, strict=True)])
    for i, (c, n) in enumerate(zip(caches[alone], nexts, strict=True)):
        want = alone.step([Seq(c, n, outs[i])])[0]
        assert torch.equal(got[i], want)
        mine = caches[fast][i]
        assert mine.length == c.length and mine.tokens == c.tokens
        n = c.length  # past it a cache holds whatever its allocation held (never read)
        assert all(torch.equal(a[:n], b[:n]) for a, b in zip(mine.k + mine.v, c.k + c.v,
                                                              strict=True))  # fmt: skip
    v, h = tiny_moe.spec.vocab_size, tiny_moe.spec.hidden
    assert [tuple(g.shape) for g in got] == [(1, v), (6, h), (5, v)]
    assert torch.equal(fast.route_counts, alone.route_counts)


def test_a_paged_cache_gives_the_bits_of_a_contiguous_one(
    tiny_moe: Model, kernels: CpuExperts
) -> None:
    """The stack over a pool of KV blocks in a random order (a prompt chunk across a block
    boundary, a decode token over three blocks, a first prompt ending inside a block): the
    hidden rows, the routing and the keys and values (read through the tables) of the same
    call over contiguous caches."""
    stack = ReferenceForward(tiny_moe, weights=QuantWeights(kernels)).stack
    assert isinstance(stack, MoEStack)
    spec, n, block = tiny_moe.spec, len(stack.layers), 8
    spans = [(5, 6), (19, 1), (0, 11)]
    gen = torch.Generator().manual_seed(11)
    caches = [tuple([torch.randn(start + t, spec.n_kv_heads, spec.head_dim, generator=gen).half()
                     for _ in range(n)] for _ in "kv") for start, t in spans]  # fmt: skip
    x = torch.randn(sum(t for _, t in spans), spec.hidden, generator=gen)
    positions = torch.cat([torch.arange(start, start + t) for start, t in spans])
    cos, sin = rope_tables(spec, positions, torch.device("cpu"))
    pool_k, pool_v, tables = paged(caches, spans, block, seed=2)
    want = x.clone()
    want_ids = stack(want, [CacheSpan(k, v, start, t) for (k, v), (start, t) in
                            zip(caches, spans, strict=True)], cos, sin)  # fmt: skip
    paged_spans = [CacheSpan(pool_k, pool_v, start, t, table, block)
                   for (start, t), table in zip(spans, tables, strict=True)]  # fmt: skip
    ids = stack(x, paged_spans, cos, sin)
    assert torch.equal(x, want) and torch.equal(ids, want_ids)
    for (start, t), (k, v), table in zip(spans, caches, tables, strict=True):
        r = pool_rows(table, block, start + t)
        assert all(torch.equal(pool[r], c) for pool, c in zip(pool_k + pool_v, k + v, strict=True))


def test_the_portable_kernels_agree(tiny_moe: Model, kernels: CpuExperts) -> None:
    prompt = list(range(7, 17))
    fast = ReferenceForward(tiny_moe, weights=QuantWeights(kernels))
    plain = ReferenceForward(tiny_moe, weights=QuantWeights(CpuExperts(2, native=False)))
    a, b = (f(prompt, f.new_cache(16), all_logits=True) for f in (fast, plain))
    assert (a - b).abs().max() < TOL


def test_bad_inputs_are_refused(tiny_moe: Model, kernels: CpuExperts) -> None:
    fast = ReferenceForward(tiny_moe, weights=QuantWeights(kernels))
    stack = fast.stack
    assert isinstance(stack, MoEStack)
    cache = fast.new_cache(4)
    cache.reserve(4)  # one block of the pool
    table, size = cache.host_table(), cache.block_size
    x = torch.zeros(2, tiny_moe.spec.hidden)
    cos = torch.zeros(2, tiny_moe.spec.head_dim // 2)
    with pytest.raises(ValueError, match="x must be"):
        stack(x[:, :32].contiguous(), [CacheSpan(cache.k, cache.v, 0, 2, table, size)], cos, cos)
    with pytest.raises(ValueError, match="cannot hold"):  # past the one block its table holds
        stack(x, [CacheSpan(cache.k, cache.v, size - 1, 2, table, size)], cos, cos)
    own = [t[:4].clone() for t in cache.k], [t[:4].clone() for t in cache.v]
    with pytest.raises(ValueError, match="cannot hold"):  # a contiguous cache of 4 rows
        stack(x, [CacheSpan(*own, 3, 2)], cos, cos)
    layer = stack.layers[0]
    swapped = dataclasses.replace(layer, weights=layer.weights[1:2] + layer.weights[1:])
    with pytest.raises(ValueError, match="holds"):  # k's blocks where q's belong
        MoEStack(kernels, stack.shape, [swapped])


def test_a_layer_the_call_does_not_cover_runs_layer_by_layer(
    tiny_moe: Model, kernels: CpuExperts
) -> None:
    """A shared expert (Qwen2-MoE's) is not in the one call: the torch layers run instead."""
    from stratad.engine.reference.cpu_stacks import moe_stack
    from stratad.model.archs import ARCHS
    from stratad.model.weights import MLPWeights, MoEWeights

    spec, reads = tiny_moe.spec, QuantWeights(kernels).reads
    layers = [ARCHS[spec.arch].layer(tiny_moe, i) for i in range(spec.n_layers)]
    assert moe_stack(kernels, reads, spec, layers) is not None
    m = layers[0].mlp
    assert isinstance(m, MoEWeights)
    shared = MLPWeights(m.experts.gate, m.experts.up, m.experts.down)
    layers[0] = dataclasses.replace(layers[0], mlp=dataclasses.replace(m, shared=shared))
    assert moe_stack(kernels, reads, spec, layers) is None


def test_a_nan_hidden_state_routes_to_real_experts(tiny_moe: Model, kernels: CpuExperts) -> None:
    """Keys never written (NaN here) make the hidden state NaN: the router still names an
    expert for every item (an id of -1 wrote before its arrays and corrupted the heap)."""
    stack = ReferenceForward(tiny_moe, weights=QuantWeights(kernels)).stack
    assert isinstance(stack, MoEStack)
    spec = tiny_moe.spec
    own = [torch.full((8, spec.n_kv_heads, spec.head_dim), float("nan"), dtype=torch.float16)
           for _ in range(2 * spec.n_layers)]  # fmt: skip
    x = torch.randn(2, spec.hidden)
    cos = torch.zeros(2, spec.head_dim // 2)
    ids = stack(x, [CacheSpan(own[: spec.n_layers], own[spec.n_layers :], 3, 2)], cos, cos)
    assert ids is not None and int(ids.min()) >= 0 and int(ids.max()) < spec.n_experts
    assert torch.isnan(x).all()
