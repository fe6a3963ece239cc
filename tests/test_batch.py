"""The batched forward: B sequences per step, each token stream equal to running it alone.

The reference engine defines every sequence's greedy tokens, run one sequence at a time. The
offload engine runs them as one batch: their prompts packed into shared prefill chunks
(staged and fused), then decode steps of every sequence still running, so the batch shrinks
as sequences finish (B = 5 down to 1), across the VRAM, RAM and file tiers and each miss path.
"""

from __future__ import annotations

import pytest
import torch

from kernels.tuning.configs import INTERPRETED, KernelConfigs
from stratad.engine.batch import Output, Seq, check_batch, chunks
from stratad.engine.kv import KVCache, pool_tokens
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.stages import StagedForward
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from stratad.model.synth import get_preset, write_synth
from stratad.store.loader import load_model

# ragged: a one-token prompt, prompts shorter and longer than a 16-token chunk
PROMPTS = [list(range(100, 103)), list(range(200, 207)), [300], list(range(400, 420)),
           list(range(500, 511))]  # fmt: skip
STEPS = [4, 2, 5, 3, 1]  # tokens each sequence generates: the batch shrinks as they finish


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("tiny") / "tiny-moe.gguf"
    write_synth(get_preset("tiny-moe"), path)
    return load_model(path)


@pytest.fixture(scope="module")
def alone(tiny_moe: Model) -> list[list[int]]:
    """Each sequence's greedy tokens from the reference engine, one sequence at a time."""
    ref = ReferenceForward(tiny_moe)
    out = []
    for prompt, n in zip(PROMPTS, STEPS, strict=True):
        cache = ref.new_cache(64)
        logits, tokens = ref(prompt, cache)[-1], []
        for _ in range(n):
            tokens.append(int(logits.argmax()))
            logits = ref([tokens[-1]], cache)[-1]
        out.append(tokens)
    return out


def batched(engine, which: list[int]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Greedy tokens of the sequences `which`, all run in one batch."""
    caches = [engine.new_cache(64) for _ in which]
    logits = engine.step([Seq(c, PROMPTS[b]) for c, b in zip(caches, which, strict=True)])
    out = [[int(lg[-1].argmax())] for lg in logits]
    while live := [i for i, b in enumerate(which) if len(out[i]) < STEPS[b]]:
        logits = engine.step([Seq(caches[i], [out[i][-1]]) for i in live])
        for i, lg in zip(live, logits, strict=True):
            out[i].append(int(lg[-1].argmax()))
    return out


def _offload(model: Model, device: str, ram: bool = True, **kw) -> OffloadForward:  # type: ignore[no-untyped-def]
    spec = model.spec
    budget = 3 * spec.n_layers * blob_layouts(model).slot_bytes  # 3 of 8 experts per layer in VRAM
    kw.setdefault("kernels", INTERPRETED if device == "cpu" else KernelConfigs())
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=16, **kw)
    # odd experts only in the file: the three tiers in one batch
    copies = None if ram else [[x for x in range(spec.n_experts) if x % 2 == 0]] * spec.n_layers
    return OffloadForward(model, torch.device(device), cfg, ram=copies)


def test_chunks_pack_in_order() -> None:
    assert list(chunks([3, 7, 1, 20, 11], 16)) == [
        [(0, 0, 3), (1, 0, 7), (2, 0, 1), (3, 0, 5)],
        [(3, 5, 15), (4, 0, 1)],
        [(4, 1, 10)],
    ]
    assert list(chunks([4], 16)) == [[(0, 0, 4)]]


def test_bad_batches_refused(tiny_moe: Model) -> None:
    ref = ReferenceForward(tiny_moe)
    cache = ref.new_cache(4)
    with pytest.raises(ValueError, match="share a KV cache"):
        check_batch([Seq(cache, [1]), Seq(cache, [2])])
    with pytest.raises(ValueError, match="5 tokens exceed the KV cache of 4"):
        check_batch([Seq(cache, [1] * 5)])
    with pytest.raises(ValueError, match="no new tokens"):
        check_batch([Seq(cache, [])])


@pytest.mark.parametrize(
    ("which", "kw"),
    [
        ([0, 1, 2, 3, 4], {"gpu_miss": "copy", "ram": False}),  # B = 5, three tiers
        ([0, 2], {"gpu_miss": "in_place", "pcie_frac": 0.5}),  # a fused chunk of two prompts
    ],
    ids=["b5-files-copy", "b2-cpu-misses"],
)
def test_batch_tokens_equal_alone_cpu(
    tiny_moe: Model, alone: list[list[int]], which: list[int], kw: dict[str, object]
) -> None:
    engine = _offload(tiny_moe, "cpu", graphs=False, **kw)  # type: ignore[arg-type]
    assert batched(engine, which) == [alone[b] for b in which]
    if not kw.get("ram", True):
        assert engine.host.file_reads > 0


def test_verify_window_logits_cpu(tiny_moe: Model) -> None:
    """A sequence asking for every new token's logits (a drafted window to verify) gets the
    reference's, next to a sequence in decode."""
    ref, engine = ReferenceForward(tiny_moe), _offload(tiny_moe, "cpu")
    r_cache, a, b = ref.new_cache(64), engine.new_cache(64), engine.new_cache(64)
    ref(PROMPTS[0], r_cache)
    engine.step([Seq(a, PROMPTS[0]), Seq(b, PROMPTS[1])])
    want = ref([7, 8, 9], r_cache, all_logits=True)
    got, _ = engine.step([Seq(a, [7, 8, 9], Output.LOGITS), Seq(b, [5])])
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-3


def test_hidden_rows_cpu(tiny_moe: Model) -> None:
    """A sequence asking for its tokens' final-norm hidden states (what an embedding pools)
    gets the reference's: a prompt over two chunks beside another prompt, then one more token
    beside a decode (a step that must not be taken for a decode, which gives logits only).
    The reference's rows are the final norm's: its output matrix makes them its logits."""
    ref, engine = ReferenceForward(tiny_moe), _offload(tiny_moe, "cpu")
    r_cache, a, b = ref.new_cache(64), engine.new_cache(64), engine.new_cache(64)
    want = ref.step([Seq(r_cache, PROMPTS[3], Output.HIDDEN)])[0]
    assert want.shape == (len(PROMPTS[3]), tiny_moe.spec.hidden)
    logits = ref(PROMPTS[3], ref.new_cache(64), all_logits=True)
    assert torch.allclose(ref.lm_head(want), logits, atol=1e-4)
    got = engine.step([Seq(a, PROMPTS[3], Output.HIDDEN), Seq(b, PROMPTS[0])])[0]
    assert got.shape == want.shape and (got - want).abs().max() < 1e-3
    want = ref.step([Seq(r_cache, [5], Output.HIDDEN)])[0]
    got = engine.step([Seq(a, [5], Output.HIDDEN), Seq(b, [7])])[0]
    assert got.shape == (1, tiny_moe.spec.hidden) and (got - want).abs().max() < 1e-3


def test_staged_batch_cpu(tiny_moe: Model, alone: list[list[int]]) -> None:
    """A layer split runs the batch through both stages."""
    budget = 2 * tiny_moe.spec.n_layers * blob_layouts(tiny_moe).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=16,
                        kernels=INTERPRETED)  # fmt: skip
    cpu = torch.device("cpu")
    staged = StagedForward(tiny_moe, [cpu, cpu], [0, tiny_moe.spec.n_layers // 2,
                                                  tiny_moe.spec.n_layers], cfg)  # fmt: skip
    assert batched(staged, [0, 2]) == [alone[0], alone[2]]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("ram", [True, False])
def test_batch_tokens_equal_alone_gpu(
    tiny_moe: Model, alone: list[list[int]], graphs: bool, ram: bool
) -> None:
    engine = _offload(tiny_moe, "cuda", ram=ram, graphs=graphs)
    assert batched(engine, [0, 1, 2, 3, 4]) == alone
    if graphs and ram:  # one capture per set of caches the batch held (4, 3, 2 and 1)
        assert engine.graph.captured == 4


# 33 ragged prompts (one or two tokens: the interpreter's time goes with the routed pairs):
# batches of 1, 3, 8 and 33 sequences, beyond the fetch staging's 8 tokens
MANY = [[(37 * i + 5 * j) % 400 + 20 for j in range(1 + i % 2)] for i in range(33)]
MANY_STEPS = 2


def _greedy(engine, prompts: list[list[int]], pool=None) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """MANY_STEPS greedy tokens of each prompt, all of them in one batch, their caches of one
    KV pool (`pool`, or a new one)."""
    pool = pool or engine.new_pool(pool_tokens(len(prompts), 16))
    caches = [KVCache(pool, 16) for _ in prompts]
    logits = engine.step([Seq(c, p) for c, p in zip(caches, prompts, strict=True)])
    out = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(MANY_STEPS - 1):
        logits = engine.step([Seq(c, [o[-1]]) for c, o in zip(caches, out, strict=True)])
        for o, lg in zip(out, logits, strict=True):
            o.append(int(lg[-1].argmax()))
    return out


@pytest.fixture(scope="module")
def many_engine(tiny_moe: Model) -> OffloadForward:
    """The copy miss path, 3 of 8 experts per layer in VRAM."""
    return _offload(tiny_moe, "cpu", graphs=False)


@pytest.fixture(scope="module")
def many_alone(tiny_moe: Model) -> list[list[int]]:
    """Each prompt's greedy tokens from the reference engine, one sequence at a time."""
    ref = ReferenceForward(tiny_moe)
    return [_greedy(ref, [p])[0] for p in MANY]


@pytest.mark.parametrize("b", [1, 3, 8, 33])
def test_batch_of_b_equals_alone_cpu(
    many_engine: OffloadForward, many_alone: list[list[int]], b: int
) -> None:
    """B sequences decoded together, their experts grouped (shared experts read once for all
    their tokens; up to 8 tokens the union of misses copied once, beyond that read in place),
    get exactly the tokens each gets alone."""
    assert _greedy(many_engine, MANY[:b]) == many_alone[:b]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_batch_of_b_equals_alone_gpu(
    tiny_moe: Model, many_alone: list[list[int]], graphs: bool
) -> None:
    """B = 1, 3, 8 and 33 on the GPU, the step captured per set of caches, with expert
    prefetch on: a single sequence's steps fork the prefetch streams, and a batch's capture
    after them (which makes no guess) failed with 'dependency created on uncaptured work in
    another stream' before the prefetch joined only the streams its pass forked."""
    engine = _offload(tiny_moe, "cuda", graphs=graphs, prefetch=True)
    assert engine.prefetch.enabled
    for b in (1, 3, 8, 33):
        assert _greedy(engine, MANY[:b]) == many_alone[:b], f"B = {b}"
    if graphs:
        assert engine.graph.captured >= 4


@pytest.mark.gpu
def test_graph_per_batch_size_serves_other_caches_gpu(
    tiny_moe: Model, many_alone: list[list[int]]
) -> None:
    """A step reads every cache through the block tables, so the capture of a batch of three
    serves three other caches of the pool: no new capture, each sequence its tokens alone."""
    engine = _offload(tiny_moe, "cuda", graphs=True)
    assert engine.attention.fused_input  # every cache read and written through its table
    pool = engine.new_pool(pool_tokens(6, 16))
    first = _greedy(engine, MANY[:3], pool)
    captured = engine.graph.captured
    second = _greedy(engine, MANY[3:6], pool)  # three new caches
    assert engine.graph.captured == captured
    assert first == many_alone[:3] and second == many_alone[3:6]


@pytest.mark.gpu
def test_failed_capture_runs_the_step_eagerly_gpu(caplog: pytest.LogCaptureFixture) -> None:
    """A step that cannot be captured (here it reads a value on the host while capturing)
    runs eagerly, with one WARNING, and is not captured again."""
    from stratad.engine.kv import KVPool
    from stratad.engine.offload.decode_graph import DecodeGraph

    def step(tok, pos, caches, tables):  # type: ignore[no-untyped-def]
        if torch.cuda.is_current_stream_capturing():
            tok.sum().item()  # a host synchronisation: refused inside a capture
        return tok.float()[:, None] * 2, tok[None]

    buf = torch.zeros(8, 1, 8, device="cuda")
    caches = [KVCache(KVPool([buf], [buf.clone()], 8), 8)]
    graph = DecodeGraph(step, torch.device("cuda"), by_table=lambda _: False)
    with caplog.at_level("WARNING", logger="stratad.engine"):
        for t in (3, 4, 5):
            logits, _ = graph.replay([t], caches)
            assert logits.item() == 2 * t
    assert graph.captured == 0
    assert [r.levelname for r in caplog.records].count("WARNING") == 1
