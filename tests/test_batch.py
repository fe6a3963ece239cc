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
from stratad.engine.batch import Output, Seq, check_batch, chunks, decode_rows
from stratad.engine.kv import KVCache, pool_tokens
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.stages import StagedForward
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model

# ragged: a one-token prompt, prompts shorter and longer than a 16-token chunk
PROMPTS = [list(range(100, 103)), list(range(200, 207)), [300], list(range(400, 420)),
           list(range(500, 511))]  # fmt: skip
STEPS = [4, 2, 5, 3, 1]  # tokens each sequence generates: the batch shrinks as they finish


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_model: Model) -> Model:
    return tiny_moe_model


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


def test_decode_rows_picks_short_windows(tiny_moe: Model) -> None:
    """The decode pass takes every next token, and the windows of at most `row_tokens` while
    the pass stays within the fused rows and each window's attention short; hidden states
    and long windows deep in a context go as chunks."""
    pool = ReferenceForward(tiny_moe).new_pool(pool_tokens(6, 64))
    caches = [KVCache(pool, 64) for _ in range(6)]
    caches[4].length = 100_000  # deep in a long context (only the length is read)
    seqs = [Seq(caches[0], [1]), Seq(caches[1], [1] * 40), Seq(caches[2], [1] * 30),
            Seq(caches[3], [1] * 20, Output.LOGITS), Seq(caches[4], [1] * 3),
            Seq(caches[5], [1] * 3, Output.HIDDEN)]  # fmt: skip
    # 1 + 40 rows; 30 more would pass 64; 20 fit; 3 more fit but read 3 x 100,003 keys;
    # hidden states come from chunks
    assert decode_rows(seqs, 64) == [True, True, False, True, False, False]
    assert decode_rows(seqs, 8) == [True, False, False, False, False, False]
    # the next tokens first: a window that fits before them but not beside them is a chunk
    window = Seq(caches[1], [1] * 62)
    assert decode_rows([window, *[Seq(c, [1]) for c in caches[3:]]], 64) == [False] + [True] * 3
    many = [Seq(c, [1]) for c in caches] * 20  # next tokens beyond 64 rows: all decoded
    assert all(decode_rows(many, 64))


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
        # B = 5, three tiers, the prompts as rows of one decode pass
        ([0, 1, 2, 3, 4], {"gpu_miss": "copy", "ram": False}),
        # a fused chunk of two prompts (no rows), a CPU share of the misses
        ([0, 2], {"gpu_miss": "in_place", "pcie_frac": 0.5, "row_tokens": 1}),
    ],
    ids=["b5-files-copy", "b2-cpu-misses"],
)
def test_batch_tokens_equal_alone_cpu(
    tiny_moe: Model, alone: list[list[int]], which: list[int], kw: dict[str, object]
) -> None:
    engine = _offload(tiny_moe, "cpu", graphs=False, **kw)  # type: ignore[arg-type]
    assert batched(engine, which) == [alone[b] for b in which]
    if not kw.get("ram", True):
        assert engine.ram.file_reads > 0


@pytest.mark.parametrize("row_tokens", [64, 1], ids=["rows", "chunk"])
def test_verify_window_logits_cpu(tiny_moe: Model, row_tokens: int) -> None:
    """A sequence asking for every new token's logits (a drafted window to verify) gets the
    reference's, next to a sequence in decode: as rows of the decode pass, or as a chunk."""
    ref, engine = ReferenceForward(tiny_moe), _offload(tiny_moe, "cpu", row_tokens=row_tokens)
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
def test_verify_window_logits_gpu(tiny_moe: Model) -> None:
    """A drafted window as rows of a captured decode pass, next to a decode, each window
    length padded to its capture's row count: the reference's logits."""
    ref, engine = ReferenceForward(tiny_moe), _offload(tiny_moe, "cuda", graphs=True)
    r_cache, a, b = ref.new_cache(64), engine.new_cache(64), engine.new_cache(64)
    ref(PROMPTS[0], r_cache)
    engine.step([Seq(a, PROMPTS[0]), Seq(b, PROMPTS[1])])
    for window in ([7, 8], [9, 10, 11, 12, 13]):  # 3 and 6 rows
        want = ref(window, r_cache, all_logits=True)
        got, _ = engine.step([Seq(a, window, Output.LOGITS), Seq(b, [5])])
        assert got.shape == want.shape
        assert (got - want.to(got.device)).abs().max() < 1e-3
    assert engine.graph.captured == 3  # the prompts' 10 rows (as 12), then 3 and 6


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("ram", [True, False])
def test_batch_tokens_equal_alone_gpu(
    tiny_moe: Model, alone: list[list[int]], graphs: bool, ram: bool
) -> None:
    engine = _offload(tiny_moe, "cuda", ram=ram, graphs=graphs)
    assert batched(engine, [0, 1, 2, 3, 4]) == alone
    if graphs and ram:  # a capture per row count: the prompts' 42 rows (padded to 48), then
        assert engine.graph.captured == 5  # decode steps of 4, 3, 2 and 1 sequences


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


@pytest.mark.parametrize("b", [1, 3, 8, 12])  # 12: past the staging's 8 (33 on the GPU)
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
    second = _greedy(engine, MANY[4:7], pool)  # three new caches, their prompts as many rows
    assert engine.graph.captured == captured
    assert first == many_alone[:3] and second == many_alone[4:7]


@pytest.mark.gpu
def test_prepare_captures_every_row_count_gpu(
    tiny_moe: Model, alone: list[list[int]]
) -> None:
    """`prepare` captures the step of every row count for the caches of a pool, so that a
    batch on other caches of the pool (prompts as rows, then decodes) captures nothing."""
    from stratad.engine.offload.decode_graph import SIZES

    engine = _offload(tiny_moe, "cuda", graphs=True)
    pool = engine.new_pool(pool_tokens(6, 64))
    engine.prepare(KVCache(pool, 64))
    assert engine.graph.captured == len(SIZES)
    caches = [KVCache(pool, 64) for _ in PROMPTS]
    logits = engine.step([Seq(c, p) for c, p in zip(caches, PROMPTS, strict=True)])
    out = [[int(lg[-1].argmax())] for lg in logits]
    while live := [b for b in range(len(PROMPTS)) if len(out[b]) < STEPS[b]]:
        logits = engine.step([Seq(caches[b], [out[b][-1]]) for b in live])
        for b, lg in zip(live, logits, strict=True):
            out[b].append(int(lg[-1].argmax()))
    assert out == alone
    assert engine.graph.captured == len(SIZES)


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
            logits, _ = graph.replay([t], [0], caches)
            assert logits.item() == 2 * t
    assert graph.captured == 0
    assert [r.levelname for r in caplog.records].count("WARNING") == 1
