"""The step loop: several requests advanced together, one batched forward per step, each
request's tokens equal to running it alone through the generator on the reference engine."""

from __future__ import annotations

import pytest
import torch

from kernels.tuning.configs import INTERPRETED
from stratad.engine.kv import KVCache, pool_tokens
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from stratad.model.text.tokenizer import Tokenizer
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.prefix import PrefixStore
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest, Sequence
from stratad.runtime.step import StepLoop
from stratad.runtime.step_plan import StepBudget

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_moe_model: Model) -> tuple[Model, Tokenizer]:
    return tiny_moe_model, tokenizer_from_gguf(tiny_moe_model.metadata)


def _requests(tok: Tokenizer) -> list[GenerationRequest]:
    texts = ["Hello there", "The capital of France is a city that", "A"]
    return [
        GenerationRequest(tok.encode(t, add_special=True), max_tokens=n, sampling=GREEDY,
                          ignore_eos=True)
        for t, n in zip(texts, (4, 2, 6), strict=True)
    ]  # fmt: skip


def test_step_loop_runs_requests_together(tiny: tuple[Model, Tokenizer]) -> None:
    model, tok = tiny
    reqs = _requests(tok)
    alone = Generator(ReferenceForward(model), tok, max_context=64, prefill_chunk=8)
    want = [[e.token for e in alone.run(r)] for r in reqs]

    budget = 3 * model.spec.n_layers * blob_layouts(model).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=8,
                        kernels=INTERPRETED, graphs=False)  # fmt: skip
    engine = OffloadForward(model, torch.device("cpu"), cfg)
    pool = engine.new_pool(pool_tokens(len(reqs), 64))
    loop = StepLoop(engine, StepBudget.auto(8, 3), prefixes=PrefixStore(0, 0), kv=pool)
    seqs = [Sequence(r, KVCache(pool, 64), tok, 64) for r in reqs]
    for s in seqs:
        loop.add(s)
    got: dict[int, list[int]] = {i: [] for i in range(len(seqs))}
    sizes = []
    while loop.running:
        sizes.append(len(loop.running))
        for s, event in loop.step():
            got[seqs.index(s)].append(event.token)
    assert [got[i] for i in range(len(seqs))] == want
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert sizes[0] == 3 and sizes[-1] == 1  # the batch shrinks as requests finish
    with pytest.raises(ValueError, match="the loop's KV pool"):
        loop.add(Sequence(reqs[0], engine.new_cache(64), tok, 64))
    with pytest.raises(ValueError, match="one running sequence"):
        loop.add(seqs[0])
        loop.add(Sequence(reqs[0], seqs[0].cache, tok, 64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_conversation_set_aside_comes_back_whole(
    tiny: tuple[Model, Tokenizer], device: str
) -> None:
    """A snapshot's copy to the host (from a GPU: queued into page-locked memory, not waited
    for) holds the rows as they were when it was taken, though the pool is overwritten right
    after, and a restore into another cache gives them back."""
    from stratad.engine.kv import KVPool

    spec = tiny[0].spec
    pool = KVPool.allocate(spec, pool_tokens(2, 64), [torch.device(device)] * spec.n_layers,
                           torch.float32)  # fmt: skip
    cache = KVCache(pool, 64)
    cache.reserve(40)
    rows = cache.rows(0, 40, torch.device(device))
    g = torch.Generator().manual_seed(1)
    want = [(torch.randn(k[rows].shape, generator=g), torch.randn(v[rows].shape, generator=g))
            for k, v in zip(pool.k, pool.v, strict=True)]  # fmt: skip
    for (k, v), (wk, wv) in zip(zip(pool.k, pool.v, strict=True), want, strict=True):
        k[rows], v[rows] = wk.to(device), wv.to(device)
    cache.length = 40
    cache.tokens[:] = list(range(40))
    store = PrefixStore(1 << 30, 0)
    assert store.save(cache, 40)
    for k, v in zip(pool.k, pool.v, strict=True):  # the next step writes over them
        k[rows], v[rows] = 0.0, 0.0
    cache.release()
    other = KVCache(pool, 64)
    store.restore(store.snapshots[0], 40, other)
    back = other.rows(0, 40, torch.device(device))
    for (k, v), (wk, wv) in zip(zip(pool.k, pool.v, strict=True), want, strict=True):
        assert torch.equal(k[back].cpu(), wk) and torch.equal(v[back].cpu(), wv)
