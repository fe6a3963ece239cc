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
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache, KVPool, pool_tokens
from stratad.engine.kv_format import INT8
from stratad.engine.offload import attention as offload_attention
from stratad.engine.offload.config import pool_spec
from stratad.engine.offload.experts import fast_path_refusal
from stratad.engine.offload.forward import OffloadForward
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.layers import attention
from stratad.model.spec import Model, ModelError
from stratad.model.synthetic import writer as synth
from stratad.runtime.prefix import PrefixStore
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


@pytest.mark.parametrize("compiled", [True, False])
def test_gpt_oss_with_a_cpu_share_of_the_misses(oss: Model, compiled: bool) -> None:
    """The CPU computes half of each step's missed experts with their biases and the clamped
    SwiGLU (the compiled kernels, or torch where none are built): the reference's tokens, the
    logits within the int8 activations' rounding; the daemon's "balanced" share is taken."""
    off = assert_as_reference(oss, "cpu", 4, 0.15, graphs=False, pcie_frac=0.5,
                              cpu_kernels=compiled)  # fmt: skip
    assert off.cpu.experts > 0 and off.cpu.ffn.biases and off.cpu_math.startswith(
        "compiled" if compiled else "torch")
    off.set_pcie_frac(0.75)
    assert off.config.pcie_frac == 0.75


def test_deepseek(deepseek: Model) -> None:
    """DeepSeek's layout: multi-head latent attention over its latent cache (queries through
    their latent, then into the kv latent through each head's key expansion; the cache one
    head of the normed latent and the shared rotated key, read as keys and values; the output
    through each head's value expansion; YaRN's score scale) in the decode kernel and in
    prefill's chunks, against the reference, which expands every head's keys and values; the
    dense first layer, grouped sigmoid routing, the shared expert."""
    assert fast_path_refusal(deepseek) is None
    off = assert_as_reference(deepseek, "cpu", 6, 1e-3, graphs=False)
    spec, pool = deepseek.spec, off.new_pool(64)
    assert spec.mla is not None and spec.n_kv_heads == spec.n_heads > 1
    latent = (1, spec.mla.kv_lora_rank + spec.mla.rope_dim)  # one head a token
    assert pool.k[1].shape[1:] == latent and pool.k[0].shape[0] >= 64
    assert pool.values_are_keys and all(v is k for k, v in zip(pool.k, pool.v, strict=True))
    assert pool.block_bytes == spec.n_layers * pool.block_size * 80 * 4  # float32, held once


# ragged prompts: a decode pass's rows, or prompt chunks, then decode steps of all three
RAGGED = [list(range(100, 103)), list(range(200, 207)), list(range(400, 420))]


def _batched(engine: OffloadForward | ReferenceForward, n: int) -> list[torch.Tensor]:
    """Each of RAGGED's last logits after n greedy steps, the three in one batch a step."""
    caches = [engine.new_cache(64) for _ in RAGGED]
    logits = engine.step([Seq(c, p) for c, p in zip(caches, RAGGED, strict=True)])
    for _ in range(n):
        tokens = [[int(lg[-1].argmax())] for lg in logits]
        logits = engine.step([Seq(c, t) for c, t in zip(caches, tokens, strict=True)])
    return [lg[-1].float().cpu() for lg in logits]


@pytest.fixture(scope="module")
def deepseek_alone(deepseek: Model) -> list[torch.Tensor]:
    """Each of RAGGED's last logits after 3 greedy steps on the reference, alone."""
    ref, want = ReferenceForward(deepseek), []
    for p in RAGGED:
        cache = ref.new_cache(64)
        logits = ref(p, cache)[-1]
        for _ in range(3):
            logits = ref([int(logits.argmax())], cache)[-1]
        want.append(logits.float())
    return want


@pytest.mark.parametrize("row_tokens", [64, 1], ids=["rows", "chunks"])
def test_deepseek_latent_batches(
    deepseek: Model, deepseek_alone: list[torch.Tensor], row_tokens: int
) -> None:
    """Three sequences of ragged prompts in each step over the latent cache (the prompts as
    a pass's rows, or as chunks attended in torch; then batched decodes), each sequence's
    logits the reference's alone; an int8 pool of the latent rows the same tokens, the logits
    within 5% of their range: one scale a token rounds its 64 + 16 values (here up to 2.5%
    of the range off, against 0.5% for the reference's int8 rows of a head each)."""
    want = deepseek_alone
    off = tiny_offload(deepseek, "cpu", row_tokens=row_tokens, graphs=False)
    for got, w in zip(_batched(off, 3), want, strict=True):
        assert (got - w).abs().max() < 1e-3
    int8 = tiny_offload(deepseek, "cpu", row_tokens=row_tokens, graphs=False, kv_format=INT8)
    for got, w in zip(_batched(int8, 3), want, strict=True):
        assert int(got.argmax()) == int(w.argmax())
        assert (got - w).abs().max() < 0.05 * w.abs().max()


def greedy_steps(engine: OffloadForward, cache: KVCache, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` on `cache` (one sequence a step)."""
    logits = engine.step([Seq(cache, prompt)])
    out = [int(logits[0][-1].argmax())]
    for _ in range(n - 1):
        out.append(int(engine.step([Seq(cache, [out[-1]])])[0][-1].argmax()))
    return out


def test_deepseek_latent_rows_in_a_resident_window(deepseek: Model) -> None:
    """Latent rows past a window of 16 go to the host tier (blocks of 8: a 40-token prompt in
    chunks of 16, then decodes), held once there too, and the greedy tokens are those of
    every row in the first tier."""
    spec, cpu = deepseek.spec, torch.device("cpu")
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    base = tiny_offload(deepseek, "cpu", graphs=False, row_tokens=1, max_context=64).config

    def run(window: int) -> tuple[list[int], KVCache]:
        cfg = replace(base, kv_resident=window, prefill_chunk=16)
        engine = OffloadForward(deepseek, cpu, cfg)
        pool = KVPool.allocate(pool_spec(spec), 48 if window else 64, [cpu] * spec.n_layers,
                               torch.float32, block_size=8, window=window,
                               host_tokens=32 if window else 0, values_are_keys=True)  # fmt: skip
        cache = KVCache(pool, 64)
        return greedy_steps(engine, cache, prompt, 4), cache

    (want, _), (got, cache) = run(0), run(16)
    assert got == want
    assert [cache.pool.on_host(b) for b in cache.blocks] == [True] * 3 + [False] * 3
    assert all(t.k is t.v for t in cache.pool.host)


def test_deepseek_latent_rows_in_a_prefix_snapshot(deepseek: Model) -> None:
    """A prefix snapshot of a latent cache holds its rows once (its values are its keys) and,
    restored into another cache of the pool, continues as the conversation computed afresh."""
    prompt = [(5 * i) % 200 + 3 for i in range(24)]
    engine = tiny_offload(deepseek, "cpu", graphs=False)
    pool = engine.new_pool(pool_tokens(2, 64))
    first, second = KVCache(pool, 64), KVCache(pool, 64)
    want = greedy_steps(engine, first, prompt, 4)
    store = PrefixStore(1 << 30, 0)
    assert store.save(first, len(prompt))
    snap = store.snapshots[0]
    assert snap.v is snap.k and snap.nbytes == snap.k.nbytes
    store.restore(snap, len(prompt) - 1, second)
    assert greedy_steps(engine, second, prompt[-1:], 4) == want


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("arch", ["glm", "oss", "deepseek"])
def test_on_the_gpu(arch: str, graphs: bool, request: pytest.FixtureRequest) -> None:
    """Each layout on a GPU against the reference, decode steps captured or eager."""
    model = request.getfixturevalue(arch)
    off = assert_as_reference(model, "cuda", 16, 1e-2, graphs=graphs, prefetch=True)
    assert off.replays_decode == graphs


@pytest.mark.gpu
def test_gpt_oss_cpu_share_on_the_gpu(oss: Model) -> None:
    """gpt-oss's CPU share of the misses beside the GPU's (the step in captured pieces)."""
    off = assert_as_reference(oss, "cuda", 16, 0.15, pcie_frac=0.5)
    assert off.cpu.experts > 0 and off.split.captured == 1
