"""Qwen3-Next on the GPU engine (`stratad/engine/offload/linear_attention.py`) against the
reference engine, on the tiny synthetic file with Q8_0 experts: its Gated DeltaNet layers, each
cache's recurrent state (what a captured decode step needs of it), a resident window beside it.
On the CPU the Triton kernels run in the interpreter; the GPU variant asks for captured steps
(each set of caches' own capture) and eager ones.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.experts.moe_dots_q8 import dequantize_q8_ref, quantize_q8_ref
from kernels.formats.quant import QType
from stratad.engine.batch import Seq, decode_inputs
from stratad.engine.kv import KVCache, KVPool
from stratad.engine.offload.decode_graph import SIZES
from stratad.engine.offload.experts import fast_path_refusal
from stratad.engine.offload.forward import OffloadForward
from stratad.engine.offload.projection import GgufMatrix
from stratad.engine.recurrent import state_bytes
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model, ModelError
from stratad.model.synthetic import writer as synth
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.prefix import PrefixStore
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest
from stratad.runtime.speculation.settings import Speculation
from stratad.store.loader import load_model
from tests.greedy import greedy
from tests.known_drafts import KnownAnswer
from tests.offload_engine import PROMPT, assert_as_reference, tiny_offload


@pytest.fixture(scope="module")
def next80(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """tiny-qwen3-next with Q8_0 experts."""
    path = tmp_path_factory.mktemp("next80") / "tiny-qwen3-next-q8_0.gguf"
    synth.write_synth(replace(synth.PRESETS["tiny-qwen3-next"], ffn_qtype=QType.Q8_0), path)
    return load_model(path)


@pytest.fixture(scope="module")
def next80_q8(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """tiny-qwen3-next with every projection in Q8_0 (the dense ones too)."""
    path = tmp_path_factory.mktemp("next80q8") / "tiny-qwen3-next-all-q8_0.gguf"
    preset = replace(synth.PRESETS["tiny-qwen3-next"], ffn_qtype=QType.Q8_0, attn_qtype=QType.Q8_0)
    synth.write_synth(preset, path)
    return load_model(path)


def test_qwen3_next(next80: Model) -> None:
    """Qwen3-Next's layout: Gated DeltaNet layers (the in-projection as one product, the
    convolution, the delta rule's kernel continuing each sequence's state over a staged chunk,
    a fused one and the decode steps), the gated heads of its attention layers with RoPE over
    a quarter of each head, the shared expert behind its sigmoid gate."""
    assert fast_path_refusal(next80) is None
    off = assert_as_reference(next80, "cpu", 4, 1e-3, gpu_miss="copy", prefetch=True)
    assert off.row_tokens == 1  # a sequence's state is one row's
    with pytest.raises(ModelError, match="recurrent model's layers run on one GPU"):
        OffloadForward(next80, torch.device("cpu"), tiny_offload(next80, "cpu").config,
                       layers=range(2))  # a pipeline stage  # fmt: skip


def test_qwen3_next_states_are_each_caches_own(next80: Model) -> None:
    """What a captured decode step needs of the recurrent states, on the CPU: a step padded
    as a graph pads it (the cache's row twice: the second leaves the state alone), after a
    capture's warm-up steps (`preserved` puts the states back), gives the reference's logits
    and leaves the state one token on; a new sequence on the cache reuses its state tensors,
    zeroed."""
    ref, off = ReferenceForward(next80), tiny_offload(next80, "cpu")
    cache, prompt = off.new_cache(128), PROMPT[:10]
    token = int(off(prompt, cache)[-1].argmax())
    held = cache.recurrent
    assert held is not None
    own = [id(t) for t in (*held.conv.values(), *held.state.values())]
    # what the start plan counts a request's state at
    assert held.nbytes == state_bytes(next80.spec)
    padded, net = decode_inputs([token] * 2, [10, 10], off.device), off.deltanet
    assert net is not None
    with torch.inference_mode():  # as `decode` runs a replay: the states taken off around it
        net.begin([cache])
        cache.reserve(11)
        with net.preserved():  # a capture's two warm-up steps
            for _ in range(2):
                off._decode_pass(*padded, [cache] * 2)
        logits, _ = off._decode_pass(*padded, [cache] * 2)
        net.finish([cache], [1])
    cache.length, cache.tokens = 11, [*cache.tokens, token]
    want = ref(prompt + [token], ref.new_cache(64), all_logits=True)
    assert (logits[0] - want[-1]).abs().max() < 1e-3
    nxt = int(want[-1].argmax())
    after = ref(prompt + [token, nxt], ref.new_cache(64))[-1]
    assert (off([nxt], cache)[-1] - after).abs().max() < 1e-3
    cache.release()
    other = PROMPT[30:38]
    assert (off(other, cache)[-1] - ref(other, ref.new_cache(64))[-1]).abs().max() < 1e-3
    assert cache.recurrent is held and own == [id(t) for t in (*held.conv.values(),
                                                                *held.state.values())]  # fmt: skip


def test_qwen3_next_state_restored_from_a_snapshot(next80: Model) -> None:
    """A prefix snapshot's state (copied off with its KV) restored onto a cache that already
    holds state tensors of its own (a captured step's addresses): they take its values, and
    the next token's logits are the reference's continuing the prefix."""
    ref, off = ReferenceForward(next80), tiny_offload(next80, "cpu")
    prompt, store = PROMPT[:10], PrefixStore(0, 1 << 24)
    cache, other = off.new_cache(64), off.new_cache(64)
    token = int(off(prompt, cache)[-1].argmax())
    assert store.save(cache, len(prompt), pinned=True)
    off(PROMPT[20:26], other)
    own = other.recurrent
    (snap,) = store.snapshots
    store.restore(snap, len(prompt), other)
    want = ref(prompt + [token], ref.new_cache(64))[-1]
    assert (off([token], other)[-1] - want).abs().max() < 1e-3
    assert other.recurrent is own  # its own tensors, which took the snapshot's values


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_qwen3_next_rejected_drafts_rewind(next80: Model, device: str) -> None:
    """Two requests verifying drafts on the GPU engine (a verify pass is a span per
    sequence), some rejected midway: each goes back to its state before the pass, and both
    get the reference's greedy tokens."""
    ref, off = ReferenceForward(next80), tiny_offload(next80, device)
    prompt = PROMPT[:8]
    want = greedy(ref, prompt, 4)  # a draft of 2 (1 stands), then the tokens computed again
    req = GenerationRequest(prompt, max_tokens=4, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True)  # fmt: skip
    spec = Speculation(KnownAnswer(want), max_draft=3)
    gen = Generator(off, tokenizer_from_gguf(next80.metadata), 64, parallel=2,
                    speculation=spec, reuse=False)  # fmt: skip
    runs = [gen.run(req) for _ in range(2)]
    assert [[e.token for e in r] for r in runs] == [want, want]
    assert 0 < gen.loop.accepted < gen.loop.drafted


def test_qwen3_next_sequences_decode_together(next80: Model) -> None:
    """Decode steps of 3 sequences, then of 2 of them (the address table refilled), in one
    launch of the convolution and of the rule per layer: each sequence's logits are those
    of the reference continuing it alone."""
    _decode_sets(next80, tiny_offload(next80, "cpu"), ([0, 1, 2], [0, 2]), 1e-3)


def _decode_sets(model: Model, off: OffloadForward, sets: tuple[list[int], ...],
                 tol: float) -> None:  # fmt: skip
    """Three sequences of one pool prefilled, then a decode step of each set of them in
    turn (attention and its input in one launch each, through the block tables): every
    sequence's logits within `tol` of the reference continuing it alone."""
    ref = ReferenceForward(model)
    prompts = [PROMPT[:5], PROMPT[10:19], PROMPT[30:37]]
    pool = off.new_pool(3 * 64)
    caches = [KVCache(pool, 64) for _ in prompts]
    refs = [ref.new_cache(64) for _ in prompts]
    nxt = [int(off(p, c)[-1].argmax()) for p, c in zip(prompts, caches, strict=True)]
    for p, c in zip(prompts, refs, strict=True):
        ref(p, c)
    for live in sets:
        got = off.step([Seq.logits(caches[b], [nxt[b]], False) for b in live])
        assert off.deltanet is not None and off.deltanet.rows == len(live)
        for b, logits in zip(live, got, strict=True):
            want = ref([nxt[b]], refs[b])[-1]
            assert (logits[-1].cpu() - want).abs().max() < tol, f"sequence {b} in {live}"
            nxt[b] = int(want.argmax())


def test_qwen3_next_with_a_resident_window(next80: Model) -> None:
    """A resident window's host tier holds rows for the attention layer alone (the DeltaNet
    layers keep no KV in either tier): blocks of 8, a window of 16, a 40-token prompt in chunks
    of 16 and 3 decodes, the reference's greedy tokens."""
    want = greedy(ReferenceForward(next80), PROMPT[:40], 4)
    cfg = replace(tiny_offload(next80, "cpu").config, prefill_chunk=16, kv_resident=16)
    engine = OffloadForward(next80, torch.device("cpu"), cfg)
    pool = KVPool.allocate(next80.spec, 48, [torch.device("cpu")] * 4, torch.float32,
                           block_size=8, window=16, host_tokens=32)  # fmt: skip
    assert [t.k.shape[0] for t in pool.host] == [0, 0, 0, 32]
    cache = KVCache(pool, 64)
    got = [int(engine(PROMPT[:40], cache)[-1].argmax())]
    for _ in range(3):
        got.append(int(engine([got[-1]], cache)[-1].argmax()))
    assert got == want
    assert [pool.on_host(b) for b in cache.blocks] == [True] * 3 + [False] * 3


def test_qwen3_next_with_a_cpu_share_of_the_misses(next80: Model) -> None:
    """The CPU computes half of a step's missed experts (`split_step`: the step in pieces, the
    host's turn between them) beside the DeltaNet layers' states: the reference's tokens, the
    logits within the int8 activations' rounding (as for the other layouts)."""
    off = assert_as_reference(next80, "cpu", 4, 0.15, pcie_frac=0.5, graphs=False)
    assert off.cpu.experts > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_qwen3_next_dense_projections_as_blocks(
    next80_q8: Model, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dense_gguf`: the DeltaNet layers' in and out projections and the gated attention's
    (its queries and gates split as the blocks' rows) held as Q8_0 blocks alone. Prefill (a
    12-token prompt: more rows than the int8 dots take) runs GEMMs over slices dequantized as
    it goes: the reference's logits. Decode dots the blocks in int8: the logits of the same
    engine with those dots done in torch on the activations rounded to their Q8 rows. (Against
    the reference they move 1 to 35% on single tokens of this random model, the rounding
    alone: a greedy token flips at the third step.)"""
    ref = ReferenceForward(next80_q8)
    off = tiny_offload(next80_q8, device, dense_gguf=True)
    kinds = {(w.deltanet is not None, isinstance(w.qkv, GgufMatrix), isinstance(w.o, GgufMatrix))
             for w in off.layers.values()}  # fmt: skip
    assert kinds == {(True, True, True), (False, True, True)}
    prompt, tokens = PROMPT[:12], [7]

    def run(engine: object) -> list[torch.Tensor]:
        cache = engine.new_cache(64)  # type: ignore[attr-defined]
        return [engine([*t], cache)[-1].cpu() for t in ([*prompt], *([t] for t in tokens))]  # type: ignore[operator]

    kernel, want = run(off), run(ref)
    assert (kernel[0] - want[0]).abs().max() < 1e-4

    def emulated(self: GgufMatrix, x: torch.Tensor, _: object) -> torch.Tensor:
        rounded = dequantize_q8_ref(quantize_q8_ref(x.float().cpu()), x.shape[1])
        return self.dequantized(rounded.to(x.device, x.dtype))

    monkeypatch.setattr(GgufMatrix, "__call__", emulated)
    for got, emul, plain in zip(kernel[1:], run(off)[1:], want[1:], strict=True):
        assert (got - emul).abs().max() < 1e-3 and not torch.equal(got, plain)


@pytest.mark.gpu
def test_qwen3_next_steps_captured_per_size(next80: Model) -> None:
    """Decode steps of two sequences, then of other pairs of the same caches: every pair
    replays the first pair's capture (the attention input written through the block tables,
    the states read through the address table), each sequence's logits the reference's."""
    off = tiny_offload(next80, "cuda")
    assert off.replays_decode
    _decode_sets(next80, off, ([0, 1], [1, 2], [0, 2], [2, 0]), 1e-2)
    assert off.graph.captured == 1
    # a fresh cache's prepare captures every size at once, rows past the first as padding
    cache = off.new_cache(64)
    off.prepare(cache)
    assert off.graph.captured == 1 + len(SIZES) and cache.length == 0
    assert cache.recurrent is None
    (logits,) = off.step([Seq.logits(cache, PROMPT[:1], False)])
    want = ReferenceForward(next80)(PROMPT[:1], ReferenceForward(next80).new_cache(64))[-1]
    assert (logits[-1].cpu() - want).abs().max() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("graphs", "pcie_frac"), [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_on_the_gpu(next80: Model, graphs: bool, pcie_frac: float) -> None:
    """On a GPU against the reference, decode steps captured or eager, and with a CPU share of
    the misses (the step captured in pieces, whose warm-up passes must leave the states)."""
    tol = 1e-2 if pcie_frac == 1.0 else 0.15
    off = assert_as_reference(next80, "cuda", 16, tol, graphs=graphs, prefetch=True,
                              pcie_frac=pcie_frac)  # fmt: skip
    assert off.replays_decode == (graphs and pcie_frac == 1.0)
    assert off.split.captured == (1 if graphs and pcie_frac < 1.0 else 0)
