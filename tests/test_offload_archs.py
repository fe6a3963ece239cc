"""The GPU engine on the newer layouts against the reference engine, on tiny synthetic files
in the types the fused kernels read (their presets are F32, for the llama.cpp comparisons in
tests/test_glm4moe.py and tests/test_gpt_oss.py; this file imports no llama.cpp, so it runs
on a GPU host as it is).

On the CPU the Triton kernels run in the interpreter; the GPU variants replay graphs and
guess the next layer's experts as the daemon does.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.formats.quant import QType
from stratad.engine.batch import decode_inputs
from stratad.engine.kv import KVCache, KVPool
from stratad.engine.offload import attention as offload_attention
from stratad.engine.offload.experts import fast_path_refusal
from stratad.engine.offload.forward import OffloadForward
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.layers import attention
from stratad.model.spec import Model, ModelError
from stratad.model.synthetic import writer as synth
from stratad.store.loader import load_model
from tests.greedy import greedy
from tests.offload_engine import PROMPT, assert_as_reference, tiny_offload


def _retyped(tmp: pytest.TempPathFactory, preset: str, qtype: QType) -> Model:
    path = tmp.mktemp(preset) / f"{preset}-{qtype.name.lower()}.gguf"
    synth.write_synth(replace(synth.PRESETS[preset], ffn_qtype=qtype), path)
    return load_model(path)


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """tiny-glm with Q8_0 experts and dense feed-forward."""
    return _retyped(tmp_path_factory, "tiny-glm", QType.Q8_0)


@pytest.fixture(scope="module")
def oss(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """tiny-gpt-oss with MXFP4 experts, as gpt-oss's files hold them."""
    return _retyped(tmp_path_factory, "tiny-gpt-oss", QType.MXFP4)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """tiny-deepseek with Q8_0 experts."""
    return _retyped(tmp_path_factory, "tiny-deepseek", QType.Q8_0)


@pytest.fixture(scope="module")
def next80(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """tiny-qwen3-next with Q8_0 experts."""
    return _retyped(tmp_path_factory, "tiny-qwen3-next", QType.Q8_0)


@pytest.mark.parametrize(("gpu_miss", "prefetch"), [("copy", True), ("in_place", False)])
def test_glm(glm: Model, gpu_miss: str, prefetch: bool) -> None:
    """GLM-4.5's layout: the dense first layer in the engine's layer loop (the store's rows,
    slots, staging and the prefetch's guesses are the routed layers'), sigmoid routing with
    the correction bias and scaled weights, the ungated shared expert, RoPE over half of each
    head op by op, q/k/v biases."""
    assert fast_path_refusal(glm) is None
    off = assert_as_reference(glm, "cpu", 6, 1e-3, graphs=False, gpu_miss=gpu_miss,
                              prefetch=prefetch)  # fmt: skip
    assert off.rows == range(2) and off.route_counts.shape == (2, 8)
    assert off.experts.lookups.total > 0
    with pytest.raises(ModelError, match="first 1 layers are dense: keep engine.pcie_frac"):
        tiny_offload(glm, "cpu", graphs=False, pcie_frac=0.5)


@pytest.mark.parametrize(("gpu_miss", "rows"), [("copy", 128), ("in_place", 16)])
def test_gpt_oss(
    oss: Model, gpu_miss: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's layout: the router's bias and softmax over the top k, the experts' biases
    and clamped SwiGLU in the fused launches and the staged GEMMs, sinks and the window in
    decode attention and in prefill's pieces of query rows (one, or five of 16), the output
    projection's bias."""
    monkeypatch.setattr(offload_attention, "_ROWS", rows)
    assert fast_path_refusal(oss) is None
    assert_as_reference(oss, "cpu", 6, 1e-3, graphs=False, gpu_miss=gpu_miss)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sink_attention_is_the_references(dtype: torch.dtype, tol: float) -> None:
    """The fused attention with the sink as one more key: the reference's product (a chunk of
    5 queries after 7 cached keys, 4 query heads on 2 KV heads, sinks from -3 to 6; all keys
    seen, and a window of 3)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(12, 2, 16, generator=g).to(dtype) for _ in "kv")
    sinks = torch.tensor([-3.0, 0.5, 2.0, 6.0])
    for window in (0, 3):
        want = attention(q, k, v, 7, sinks, window)
        got = offload_attention.sink_attention(q, k, v, 7, sinks, window)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_every_expert_resident_stages_by_one_gather(oss: Model) -> None:
    """Every expert in a VRAM slot: a prefill chunk stages each layer's blobs by one gather
    from the slots; the reference's tokens."""
    want = greedy(ReferenceForward(oss), PROMPT, 3)
    cfg = replace(tiny_offload(oss, "cpu").config, expert_vram_bytes=1 << 30)
    off = OffloadForward(oss, torch.device("cpu"), cfg)
    assert all(len(s) == oss.spec.n_experts for s in off.experts.slot_of)
    assert greedy(off, PROMPT, 3) == want


def test_gpt_oss_keeps_the_cpu_share_off(oss: Model) -> None:
    """The CPU's share of the misses computes plain experts: asked for, refused, said why."""
    with pytest.raises(ModelError, match="clamped SwiGLU.*pcie_frac at 1"):
        tiny_offload(oss, "cpu", graphs=False, pcie_frac=0.5)
    off = tiny_offload(oss, "cpu", graphs=False)
    off.set_pcie_frac(0.5)  # the daemon's "balanced" after measuring the link
    assert off.config.pcie_frac == 1.0


def test_deepseek(deepseek: Model) -> None:
    """DeepSeek's layout: multi-head latent attention (queries through their latent, keys and
    values expanded from the kv latent, the shared rotated key, YaRN's score scale; values
    widened to the keys' width in the cache and cut back after attention) in the decode kernel
    and in prefill's chunks; the dense first layer, grouped sigmoid routing, the shared
    expert."""
    assert fast_path_refusal(deepseek) is None
    off = assert_as_reference(deepseek, "cpu", 6, 1e-3, graphs=False)
    pool = off.new_pool(64)
    assert pool.v[1].shape[-1] == pool.k[1].shape[-1] == deepseek.spec.head_dim


def test_qwen3_next(next80: Model) -> None:
    """Qwen3-Next's layout: Gated DeltaNet layers (the in-projection as one product, the
    convolution, the delta rule's kernel continuing each sequence's state over a staged chunk,
    a fused one and the decode steps), the gated heads of its attention layers with RoPE over
    a quarter of each head, the shared expert behind its sigmoid gate."""
    assert fast_path_refusal(next80) is None
    off = assert_as_reference(next80, "cpu", 6, 1e-3, gpu_miss="copy", prefetch=True)
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
    cache, prompt = off.new_cache(128), PROMPT[:20]
    token = int(off(prompt, cache)[-1].argmax())
    held = cache.recurrent
    assert held is not None
    own = [id(t) for t in (*held.conv.values(), *held.state.values())]
    padded, net = decode_inputs([token] * 2, [20, 20], off.device), off.deltanet
    assert net is not None
    with torch.inference_mode():  # as `decode` runs a replay: the states taken off around it
        net.begin([cache])
        cache.reserve(21)
        with net.preserved():  # a capture's two warm-up steps
            for _ in range(2):
                off._decode_pass(*padded, [cache] * 2)
        logits, _ = off._decode_pass(*padded, [cache] * 2)
        net.finish([cache], [1])
    cache.length, cache.tokens = 21, [*cache.tokens, token]
    want = ref(prompt + [token], ref.new_cache(64), all_logits=True)
    assert (logits[0] - want[-1]).abs().max() < 1e-3
    nxt = int(want[-1].argmax())
    after = ref(prompt + [token, nxt], ref.new_cache(64))[-1]
    assert (off([nxt], cache)[-1] - after).abs().max() < 1e-3
    cache.release()
    other = PROMPT[30:45]
    assert (off(other, cache)[-1] - ref(other, ref.new_cache(64))[-1]).abs().max() < 1e-3
    assert cache.recurrent is held and own == [id(t) for t in (*held.conv.values(),
                                                                *held.state.values())]  # fmt: skip


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


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("arch", ["glm", "oss", "next80", "deepseek"])
def test_on_the_gpu(arch: str, graphs: bool, request: pytest.FixtureRequest) -> None:
    """Each layout on a GPU against the reference, decode steps captured or eager (Qwen3-Next's
    captured steps asked for: `OffloadConfig.recurrent_graphs`, off by default until this has
    passed on a GPU)."""
    model = request.getfixturevalue(arch)
    off = assert_as_reference(model, "cuda", 16, 1e-2, graphs=graphs, prefetch=True,
                              recurrent_graphs=graphs)  # fmt: skip
    assert off.replays_decode == graphs
