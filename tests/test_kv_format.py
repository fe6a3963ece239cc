"""Quantized KV formats: what a reader of the stored form gets back, and the reference engine
attending over exactly those values (what `bench.kv.kv_ppl` measures)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kernels.cpu.experts import CpuExperts
from kernels.formats.kv_q4 import unpack_codes
from kernels.tuning.configs import INTERPRETED
from stratad.config import Config, EngineConfig
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache, pool_tokens
from stratad.engine.kv_format import FORMATS, INT8, PLAIN, Q4, Q4KV, Int8KV
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.placement import start_plan
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model, ModelError
from stratad.runtime.prefix import PrefixStore


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_model: Model) -> Model:
    return tiny_moe_model


def _keys() -> torch.Tensor:
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0))
    x[1, 0] = 0.0  # a zero head: scale 0, read back as zeros
    x[2, 1, 3] = 40.0  # an outlier channel, as keys have
    return x


def test_int8_reads_back_within_half_a_step() -> None:
    fmt, x = Int8KV(), _keys()
    q, scale = fmt.quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 2)
    assert int(q.abs().max()) == 127  # each head's largest value is the top level
    back = fmt.dequantize(q, scale)
    assert torch.all((back - x).abs() <= scale[..., None] / 2 + 1e-6)
    assert torch.equal(back[1, 0], torch.zeros(64))
    assert torch.equal(fmt.round_trip(x), back)


def test_q4_reads_back_within_half_a_step_per_group() -> None:
    """Two codes a byte (value 2j low, 2j + 1 high), a float16 scale and minimum per 32
    values: each value back within half a step (and the minimum's float16 rounding, which
    the codes absorb up to the clamp)."""
    fmt, x = Q4KV(), _keys()
    q, dm = fmt.quantize(x)
    assert q.dtype == torch.uint8 and q.shape == (5, 2, 32) and dm.shape == (5, 2, 2, 2)
    assert dm.dtype == torch.float16
    scale, low = dm[..., 0], dm[..., 1]
    codes = unpack_codes(q)
    assert int(codes.max()) == 15 and torch.equal(codes[..., 1::2], q >> 4)
    back = fmt.dequantize(q, dm)
    step = scale.float().repeat_interleave(32, dim=-1)
    slack = (low.float() - x.reshape(5, 2, 2, 32).amin(-1)).abs().repeat_interleave(32, dim=-1)
    # the float16 scale may sit up to 2^-11 of itself below the exact one: the clamp at 15
    assert torch.all((back - x).abs() <= step / 2 + slack + 15 * 2**-11 * step + 1e-6)
    assert torch.equal(back[1, 0], torch.zeros(64))
    with pytest.raises(ValueError, match="32-value groups"):
        fmt.quantize(torch.zeros(1, 1, 48))


def test_reference_attends_over_the_quantized_cache(tiny_moe: Model) -> None:
    """The same prompt through plain, int8 and q4 KV: int8 changes the logits a little (and
    not the next token), q4 more (this random model's keys are far from 4-bit friendly)."""
    prompt = list(range(100, 140))
    out = {}
    for name, fmt in FORMATS.items():
        ref = ReferenceForward(tiny_moe, kv_format=fmt)
        out[name] = ref(prompt, ref.new_cache(64), all_logits=True)
    plain = out["plain"]
    err = {name: float((out[name] - plain).abs().max()) for name in ("int8", "q4")}
    assert 0 < err["int8"] < 0.02 * float(plain.abs().max()) and err["int8"] < err["q4"], err
    assert int(out["int8"][-1].argmax()) == int(plain[-1].argmax())


# ragged prompts: rows of one decode pass (or chunks), then decode steps of all three
PROMPTS = [list(range(100, 103)), list(range(200, 207)), list(range(400, 420))]


def _greedy(engine, caches, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    logits = engine.step([Seq(c, p) for c, p in zip(caches, PROMPTS, strict=True)])
    out = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(n - 1):
        logits = engine.step([Seq(c, [o[-1]]) for c, o in zip(caches, out, strict=True)])
        for o, lg in zip(out, logits, strict=True):
            o.append(int(lg[-1].argmax()))
    return out


def _int8_reference(tiny_moe: Model) -> list[list[int]]:
    """Each prompt's 4 greedy tokens from the reference over int8-rounded keys and values."""
    ref = ReferenceForward(tiny_moe, kv_format=Int8KV())
    want = []
    for p in PROMPTS:
        cache = ref.new_cache(64)
        logits, toks = ref(p, cache)[-1], []
        for _ in range(4):
            toks.append(int(logits.argmax()))
            logits = ref([toks[-1]], cache)[-1]
        want.append(toks)
    return want


def _int8_engine(tiny_moe: Model, device: str, **kw) -> OffloadForward:  # type: ignore[no-untyped-def]
    budget = 3 * tiny_moe.spec.n_layers * blob_layouts(tiny_moe).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, kv_format=INT8, **kw)
    return OffloadForward(tiny_moe, torch.device(device), cfg)


@pytest.mark.gpu
def test_offload_int8_kv_tokens_equal_the_reference_gpu(tiny_moe: Model) -> None:
    """On the GPU: the fused input kernel writes the ints and scales, the captured steps
    (prompts as rows, then decodes) read them."""
    engine = _int8_engine(tiny_moe, "cuda", graphs=True)
    pool = engine.new_pool(pool_tokens(3, 64))
    assert engine.attention.fused_input
    assert _greedy(engine, [KVCache(pool, 64) for _ in PROMPTS], 4) == _int8_reference(tiny_moe)


@pytest.mark.parametrize("row_tokens", [64, 1], ids=["rows", "chunks"])
def test_offload_int8_kv_tokens_equal_the_reference_cpu(tiny_moe: Model, row_tokens: int) -> None:
    """The offload engine with an int8 pool (its kernels read the ints and scales) against the
    reference attending over the same rounded values: the same greedy tokens, the prompts as
    decode rows or as chunks (attended with torch over their dequantized rows)."""
    want = _int8_reference(tiny_moe)
    engine = _int8_engine(tiny_moe, "cpu", kernels=INTERPRETED, graphs=False,
                          row_tokens=row_tokens)  # fmt: skip
    pool = engine.new_pool(pool_tokens(3, 64))
    assert pool.quantized and pool.k[0].dtype == torch.int8
    caches = [KVCache(pool, 64) for _ in PROMPTS]
    assert _greedy(engine, caches, 4) == want
    assert float(pool.k_scale[0].abs().sum()) > 0  # the scales were written
    # the prefix store holds plain rows: an int8 conversation is not set aside (its blocks
    # stay the pool's hits), and a plain one of the same length is
    assert not PrefixStore(1 << 30, 0).save(caches[2], 20)
    plain = ReferenceForward(tiny_moe)
    cache = plain.new_cache(64)
    plain(PROMPTS[2], cache)
    assert PrefixStore(1 << 30, 0).save(cache, 20)


def test_quantized_kv_in_the_start_plan(tiny_moe: Model) -> None:
    """engine.kv_cache = int8 halves the offload engine's KV bytes (plus a float32 scale per
    token and KV head) and the cpu engine's (halves there); q4 is half a byte a value and a
    float16 scale and minimum per 32; the reference engine keeps plain KV."""
    spec, cpu = tiny_moe.spec, torch.device("cpu")
    kv = {}
    for backend, kinds in (("offload", ("plain", "int8", "q4")), ("cpu", ("plain", "int8", "q4"))):
        for kind in kinds:
            engine = EngineConfig(backend=backend, kv_cache=kind)
            config = msgspec.structs.replace(Config(), engine=engine)
            plan = start_plan(config, tiny_moe, cpu, [None], 1 << 20, host_bytes=1 << 34)
            kv[backend, kind] = plan.parallel.kv_bytes  # a context's
    cells = 2 * spec.n_layers * min(Config().model.max_context, spec.context_length)
    int8 = cells * (spec.kv_dim + 4 * spec.n_kv_heads)
    q4 = cells * (spec.kv_dim // 2 + spec.n_kv_heads * spec.head_dim // 32 * 4)
    assert kv == {("offload", "plain"): cells * spec.kv_dim * 4,  # float32 on a CPU
                  ("offload", "int8"): int8, ("offload", "q4"): q4,
                  ("cpu", "plain"): cells * spec.kv_dim * 2, ("cpu", "int8"): int8,
                  ("cpu", "q4"): q4}  # fmt: skip
    for backend, kind, match in (("reference", "int8", "keeps plain KV"),
                                 ("reference", "q4", "keeps plain KV")):  # fmt: skip
        engine = EngineConfig(backend=backend, kv_cache=kind)
        with pytest.raises(ModelError, match=match):
            start_plan(msgspec.structs.replace(Config(), engine=engine), tiny_moe, cpu, [None],
                       1 << 20)  # fmt: skip


def test_the_cpu_engine_keeps_quantized_kv(tiny_moe: Model) -> None:
    """The cpu engine's one-call layers with an int8 or a 4-bit pool (the C loops write the
    codes and scales and read them back): half the KV bytes, or less than a third; int8's
    greedy tokens are those of its plain-KV run and its logits within int8's rounding of
    them; 4-bit's logits within its coarser rounding."""
    runs = {}
    for fmt in (PLAIN, INT8, Q4):
        engine = ReferenceForward(tiny_moe, weights=QuantWeights(CpuExperts(threads=2)),
                                  kv_format=fmt)  # fmt: skip
        pool = engine.new_pool(pool_tokens(3, 64))
        caches = [KVCache(pool, 64) for _ in PROMPTS]
        first = engine.step([Seq(c, p) for c, p in zip(caches, PROMPTS, strict=True)])
        runs[fmt.name] = (_greedy(engine, [KVCache(pool, 64) for _ in PROMPTS], 4), first, pool)
    (plain, lp, pp), (int8, li, pi), (_, l4, p4) = runs["plain"], runs["int8"], runs["q4"]
    assert pi.quantized and pi.k[0].dtype == torch.int8 and float(pi.k_scale[0].sum()) > 0
    assert p4.k[0].dtype == torch.uint8 and float(p4.k_scale[0].float().abs().sum()) > 0
    assert pi.block_bytes < 0.6 * pp.block_bytes and p4.block_bytes < 0.35 * pp.block_bytes
    assert int8 == plain
    for a, b, c in zip(lp, li, l4, strict=True):
        assert (a - b).abs().max() <= 0.05 * a.abs().max()
        assert 0 < (a - c).abs().max() <= 0.3 * a.abs().max()
