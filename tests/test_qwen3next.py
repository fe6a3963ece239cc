"""Qwen3-Next's layout (`qwen3next`) against llama.cpp and through the daemon; its recurrent
state beside the cache.

tiny-qwen3-next (`stratactl synth tiny-qwen3-next`) has every part of the layout: Gated
DeltaNet in three of four layers (2 key heads serving 4 value heads, a conv of 4), gated
full attention with q/k norms and RoPE over a quarter of each head in the fourth, routed
experts and a gated shared expert. Every tensor is F32, so llama.cpp computes in float32 on
the same values: greedy continuations agree token for token and logits within 1e-3 (measured
7e-5). The transformers comparison (value heads wider than key heads, norms of 1 + w) is in
tests/test_transformers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stratad.engine.kv_format import PLAIN
from stratad.engine.placement import kv_token_bytes
from stratad.engine.recurrent import StaleState
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.graph.deltanet import GatedDeltaNet
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.prefix import PrefixStore
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest
from stratad.runtime.speculation.settings import Speculation
from tests.daemon import greedy_completions, running_daemon
from tests.greedy import greedy
from tests.known_drafts import KnownAnswer
from tests.llama_compare import assert_as_llama
from tests.tiny_presets import preset_fixtures

PROMPTS = ["The quick brown fox jumps over the lazy dog", "def fibonacci(n):"]


_tiny_file, _model = preset_fixtures("tiny-qwen3-next", "tiny")


def test_spec_from_the_file(model: Model) -> None:
    s = model.spec
    assert s.deltanet == GatedDeltaNet(2, 4, 32, 32, 4, 4)
    assert [s.linear_layer(i) for i in range(4)] == [True, True, True, False]
    assert s.attn_gate and s.qk_norm == "head" and s.rope_dim == 16 and s.norm_topk_prob
    assert model.tensors["model.layers.0.linear_attn.a"].dequantize().max() < 0
    # KV for the attention layer alone: 1 of 4 (2 heads x (64 + 64) x 2 bytes a token)
    assert s.kv_layers == 1 and kv_token_bytes(s, torch.float16, PLAIN) == 2 * 128 * 2
    pool = ReferenceForward(model).new_pool(64)
    assert [t.shape[0] for t in pool.k] == [0, 0, 0, 64] and pool.n_blocks * pool.block_size == 64


def test_reference_engine_against_llama_cpp(tiny: Path, model: Model) -> None:
    assert_as_llama(ReferenceForward(model), tiny, PROMPTS, 16)


def test_state_continues_across_passes_and_is_never_stale(model: Model) -> None:
    """A prompt in pieces (the conv's held inputs and the state carried over) gives the
    logits of it whole; a cache cut back or emptied drops its state: a pass on the cut
    cache fails rather than compute from a wrong state, one on the emptied cache starts
    afresh."""
    forward = ReferenceForward(model)
    tokens = list(range(200, 223))
    whole = forward(tokens, forward.new_cache(64), all_logits=True)
    cache = forward.new_cache(64)
    pieces = [forward(tokens[a:b], cache, all_logits=True) for a, b in ((0, 2), (2, 13), (13, 23))]
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-4)
    assert cache.recurrent is not None and cache.recurrent.length == 23
    cache.truncate(20)  # as a rejected draft or a step queued ahead would
    assert cache.recurrent is None
    with pytest.raises(StaleState, match="holds 20 tokens and its recurrent state is none"):
        forward(tokens[20:], cache)
    cache.release()
    assert torch.equal(forward(tokens, cache, all_logits=True), whole)


def test_a_conversation_continues_its_working_cache(model: Model) -> None:
    """A request whose prompt starts with all of a working cache's conversation continues it
    (the state stands for exactly those tokens): the same tokens as computed afresh. A prompt
    that leaves the conversation earlier, or another scope's, is computed from its first
    token (the state cannot be cut back, nor shown to another client)."""
    forward = ReferenceForward(model)
    gen = Generator(forward, tokenizer_from_gguf(model.metadata), max_context=128, reuse=False)
    greedy_params = SamplingParams(temperature=0.0)

    def run(prompt: list[int], scope: str = "") -> list[int]:
        req = GenerationRequest(prompt, max_tokens=5, sampling=greedy_params, ignore_eos=True,
                                scope=scope)  # fmt: skip
        return [e.token for e in gen.run(req)]

    first = list(range(300, 320))
    run(first)
    held = list(gen.cache.tokens)
    assert held[:20] == first and gen.cache.recurrent is not None
    turn = held + [400, 401, 402]
    assert run(turn) == greedy(forward, turn, 5) and gen.cached_tokens == len(held)
    left = turn[:10] + [7, 8, 9]
    assert run(left) == greedy(forward, left, 5) and gen.cached_tokens == 0
    again = list(gen.cache.tokens) + [5]
    assert run(again, scope="another key") == greedy(forward, again, 5)
    assert gen.cached_tokens == 0


def test_conversations_and_pins_come_back_from_snapshots(model: Model) -> None:
    """With one working cache, a conversation set aside for another comes back from its
    snapshot, its recurrent state with it: the next turn reuses all of it and gives the
    tokens computed afresh; a prompt that leaves it earlier reuses none (the state stands for
    the whole snapshot). A pinned prefix is kept at the pin, where a chunk ends, and the next
    request of the scope reuses it; another scope's does not."""
    forward = ReferenceForward(model)
    store = PrefixStore(conversation_bytes=1 << 24, pinned_bytes=1 << 24)
    gen = Generator(forward, tokenizer_from_gguf(model.metadata), max_context=128,
                    prefix_store=store, reuse=False)  # fmt: skip

    def run(prompt: list[int], pin: int = 0, scope: str = "") -> list[int]:
        req = GenerationRequest(prompt, max_tokens=4, sampling=SamplingParams(temperature=0.0),
                                ignore_eos=True, pin=pin, scope=scope)  # fmt: skip
        return [e.token for e in gen.run(req)]

    run(list(range(300, 320)))
    held = list(gen.cache.tokens)
    run(list(range(500, 530)))  # takes the one cache: the first conversation set aside
    (snap,) = store.snapshots
    assert snap.tokens == tuple(held) and snap.state is not None
    assert snap.state.length == len(held) and snap.nbytes > snap.k.nbytes + snap.v.nbytes
    turn = held + [400, 401]
    assert run(turn) == greedy(forward, turn, 4) and gen.cached_tokens == len(held)
    left = held[:-3] + [9, 9, 9]
    assert run(left) == greedy(forward, left, 4) and gen.cached_tokens == 0
    doc = list(range(600, 640))
    run(doc + [1, 2], pin=len(doc))
    pinned = [s for s in store.snapshots if s.pinned]
    assert [len(s.tokens) for s in pinned] == [len(doc)]
    assert pinned[0].state is not None and pinned[0].state.length == len(doc)
    assert not store.save(gen.cache, 20, pinned=True)  # no state stands for 20 tokens
    ask = doc + [3, 4, 5]
    assert run(ask) == greedy(forward, ask, 4) and gen.cached_tokens == len(doc)
    run(ask + [6], scope="another key")
    assert gen.cached_tokens == 0


@pytest.mark.parametrize("parallel", [1, 2])
def test_drafts_rejected_take_the_state_back(model: Model, parallel: int) -> None:
    """A verify pass folds every draft into the recurrent state, so where one is rejected
    the sequence goes back to the state before the pass and computes the tokens that stood
    again: greedy tokens equal those without drafts, some drafts standing and some not; two
    requests at once each keep their own state."""
    forward, tok = ReferenceForward(model), tokenizer_from_gguf(model.metadata)
    req = GenerationRequest([5, 6, 7, 8, 9, 10] * 3, max_tokens=16,
                            sampling=SamplingParams(temperature=0.0), ignore_eos=True)  # fmt: skip

    def run(spec: Speculation | None) -> tuple[list[list[int]], Generator]:
        gen = Generator(forward, tok, 128, parallel=parallel, speculation=spec, reuse=False)
        runs = [gen.run(req) for _ in range(parallel)]
        return [[e.token for e in r] for r in runs], gen

    plain, _ = run(None)
    drafted, gen = run(Speculation(KnownAnswer(plain[0]), max_draft=3))
    assert drafted == plain
    loop = gen.loop
    assert loop.verifies > 0 and 0 < loop.accepted < loop.drafted, (loop.accepted, loop.drafted)
    cache = gen.caches[0]
    assert cache.recurrent is not None and cache.recurrent.length == cache.length
    assert cache.tokens == req.prompt + plain[0][:-1]


def test_daemon_serves_it(tiny: Path, model: Model, tmp_path: Path) -> None:
    """The daemon on the CPU (layer by layer, the experts from the store's tiers), three
    requests at once and the first again after them (a prefix it would otherwise reuse):
    each the reference's greedy tokens of its prompt alone; each request's state computed
    from its first token, said once at start."""
    tok = tokenizer_from_gguf(model.metadata)
    prompts = ["The quick brown fox jumps over", "def fibonacci(n):", "One two three four"]
    reference = ReferenceForward(model)
    want = [tok.decode(greedy(reference, tok.encode(p), 6)) for p in prompts]
    config = tmp_path / "stratad.toml"
    config.write_text('[engine]\ndevice = "cpu"\nthreads = 1\n[control]\nsocket = ""\n')
    log = tmp_path / "stratad.log"
    with running_daemon([str(tiny), "--config", str(config)], log) as url:
        got = greedy_completions(url, tiny.name, prompts, 6)
        again = greedy_completions(url, tiny.name, [prompts[0] + want[0]], 6)[0]
    assert got == want
    longer = tok.encode(prompts[0] + want[0])
    assert again == tok.decode(greedy(reference, longer, 6))
    text = log.read_text()
    assert "recurrent state lives in its working cache" in text, text
    assert " ERROR " not in text
