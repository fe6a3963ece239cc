"""Speculative decoding (prompt lookup): drafts verified in one step give exactly the tokens
of decoding without them (greedy), keep the model's distribution (sampled), and roll the KV
back past the first draft that did not stand."""

from __future__ import annotations

import pytest

from kernels.cpu.experts import CpuExperts
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.model.text.tokenizer import Tokenizer
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest
from stratad.runtime.speculation.cost import StepCost
from stratad.runtime.speculation.drafter import PromptLookup
from stratad.runtime.speculation.length import DraftLength
from stratad.runtime.speculation.settings import Speculation

GREEDY = SamplingParams(temperature=0.0)
CODE = '''def total(items):
    """The sum of the items' prices, with tax."""
    result = 0
    for item in items:
        price = item["price"] * item["count"]
        result = result + price * 1.2
    return result
'''


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    index = PromptLookup(min_n=2, max_n=3).start([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert index.propose(4) == [4, 5, 9, 1]  # after the earlier 1, 2, 3
    index.extend([7])
    assert index.propose(4) == []  # 2, 3, 7 and 3, 7 never came before
    index.extend([1, 2])
    assert index.propose(2) == [3, 7]  # the latest 1, 2 (before the tail) was followed by 3, 7
    assert PromptLookup().start([5]).propose(3) == []
    with pytest.raises(ValueError, match="n-gram sizes"):
        PromptLookup(min_n=3, max_n=2)


def test_draft_length_follows_acceptance_and_rests_when_drafts_do_not_pay() -> None:
    length = DraftLength(max_k=8, rest=3, prior=0.9)
    assert length.next(0.2) == 8  # 0.9^8 = 0.43 > 0.2
    assert length.next(0.5) == 6  # 0.9^6 = 0.53 > 0.5 > 0.9^7: a dearer token, a shorter draft
    for _ in range(20):
        length.record(1, 0)  # the first drafted token missed
    # nothing stood: three steps without a draft, then a probe of one token
    assert [length.next(0.2) for _ in range(4)] == [0, 0, 0, 1]
    length.record(1, 1)
    length.record(1, 1)
    assert length.next(0.2) == 2  # the probe stood twice: a share of 0.51, 0.51^2 > 0.2


def test_the_share_counts_the_drafted_tokens_checked() -> None:
    """Drafts of 8 whose first 3 stand and the 4th misses: 3 of 4 checked tokens stood (the
    4 after the miss were never checked), 0.75^4 = 0.32 > 0.3 > 0.75^5: drafts of 4, where
    3 of 8 drafted (0.375) would give 1."""
    length = DraftLength(max_k=8)
    for _ in range(30):
        length.record(4, 3)
    assert abs(length.rate - 0.75) < 1e-3 and length.next(0.3) == 4


def test_step_cost_measures_a_drafted_token_against_its_batch_size() -> None:
    """A drafted token's share of a decode step: from steps of the same number of sequences
    with and without drafts; the prior until both are seen; one odd step bounded."""
    cost = StepCost(prior=0.2, alpha=0.5)
    cost.observe(2, 3, 0.030)  # a verify before any plain step of 2: nothing to compare with
    assert cost.token_cost == 0.2 and not cost.measured
    cost.observe(1, 0, 0.010)
    cost.observe(2, 0, 0.020)
    cost.observe(2, 4, 0.040)  # 4 drafts doubled a step of two: 0.25 each
    assert cost.measured and cost.token_cost == pytest.approx(0.25)
    cost.observe(1, 1, 0.015)  # one draft beside one sequence: half a step
    assert cost.token_cost == pytest.approx(0.375)
    cost.observe(1, 1, 10.0)  # a stall (a capture, a swap) counts as 2 steps at most
    assert cost.token_cost == pytest.approx((0.375 + 2.0) / 2)
    assert cost.verifies == 3


@pytest.fixture(scope="module")
def cpu_engine(smollm_model: Model) -> tuple[ReferenceForward, Tokenizer]:
    """The default model on the cpu engine (its one-call layers: a verify's rows are bit for
    bit those of decoding them one at a time)."""
    forward = ReferenceForward(smollm_model, weights=QuantWeights(CpuExperts(threads=2)))
    return forward, tokenizer_from_gguf(smollm_model.metadata)


def _run(engine: tuple, req: GenerationRequest, spec: Speculation | None,
         parallel: int = 1) -> tuple[list[list[int]], Generator]:  # fmt: skip
    forward, tokenizer = engine
    gen = Generator(forward, tokenizer, 512, prefill_chunk=64, parallel=parallel,
                    speculation=spec)  # fmt: skip
    runs = [gen.run(req) for _ in range(parallel)]
    return [[e.token for e in run] for run in runs], gen


def _tokens(engine: tuple, text: str) -> list[int]:
    return engine[1].encode(text)


def test_greedy_tokens_are_those_without_drafts(cpu_engine: tuple) -> None:
    """The default model rewriting a function it was given: most drafts stand, and every
    token is the one decoding without them gives; the KV of drafts that did not stand is
    dropped (the cache holds exactly the settled tokens)."""
    prompt = _tokens(cpu_engine, f"Here is a function:\n{CODE}\nThe same function, unchanged:\n")
    req = GenerationRequest(prompt, max_tokens=48, sampling=GREEDY)
    plain, _ = _run(cpu_engine, req, None)
    spec = Speculation(PromptLookup(), max_draft=8)
    drafted, gen = _run(cpu_engine, req, spec)
    assert drafted == plain
    loop = gen.loop
    assert loop.verifies > 0 and loop.accepted > 0
    cache = gen.caches[0]
    assert cache.tokens == prompt + plain[0][:-1]  # the last token is never computed
    assert len(cache.blocks) == cache.pool.blocks_for(cache.length)


def test_a_seeded_sampled_request_draws_the_same_tokens_with_drafts_or_without(
    cpu_engine: tuple,
) -> None:
    """Sampling verifies a draft by the token it draws at that position as it would without one
    (the draft stands where they are equal: with probability p(draft), rejection sampling's
    acceptance; otherwise the token is a draw from p without the draft): a seeded request gets
    the same tokens with no drafts, short drafts or long ones, whatever the measured cost of a
    draft makes their lengths."""
    prompt = _tokens(cpu_engine, f"Here is a function:\n{CODE}\nThe same function, unchanged:\n")
    sampling = SamplingParams(temperature=0.7, seed=11)
    req = GenerationRequest(prompt, max_tokens=40, sampling=sampling)
    plain, _ = _run(cpu_engine, req, None)
    for k in (1, 8):
        drafted, gen = _run(cpu_engine, req, Speculation(PromptLookup(), max_draft=k))
        assert drafted == plain and gen.loop.accepted > 0, k


def test_stop_strings_and_budgets_end_inside_a_draft(cpu_engine: tuple) -> None:
    """A stop string or the token budget reached by a draft that stood ends the answer there,
    as without drafts; two choices of one request draft each on their own."""
    prompt = _tokens(cpu_engine, f"{CODE}\nAgain:\n{CODE[:60]}")
    spec = Speculation(PromptLookup(), max_draft=8)
    for req in (GenerationRequest(prompt, max_tokens=40, sampling=GREEDY, stop=("price",)),
                GenerationRequest(prompt, max_tokens=5, sampling=GREEDY)):  # fmt: skip
        plain, _ = _run(cpu_engine, req, None, parallel=2)
        drafted, gen = _run(cpu_engine, req, spec, parallel=2)
        assert drafted == plain and gen.loop.verifies > 0


def test_the_auto_drafter_is_prompt_lookup_on_the_cpu_engine_only() -> None:
    cpu = Speculation.from_config("auto", 8, 0.2, "cpu")
    assert cpu is not None and isinstance(cpu.drafter, PromptLookup) and cpu.max_draft == 8
    assert Speculation.from_config("auto", 8, 0.2, "offload") is None
    assert Speculation.from_config("off", 8, 0.2, "cpu") is None
    assert Speculation.from_config("prompt_lookup", 4, 0.2, "offload") is not None
    with pytest.raises(ValueError, match="speculation.drafter"):
        Speculation.from_config("draft_model", 4, 0.2, "cpu")


def test_greedy_tokens_are_those_without_drafts_on_the_tiny_moe(tiny_moe_model: Model) -> None:
    """The tiny MoE on the cpu engine (its routed experts in the one-call layers), drafts
    from one-token matches: the same tokens with and without."""
    model = tiny_moe_model
    engine = (ReferenceForward(model, weights=QuantWeights(CpuExperts(threads=2))),
              tokenizer_from_gguf(model.metadata))  # fmt: skip
    prompt = [5, 6, 7, 8, 9, 10] * 6
    req = GenerationRequest(prompt, max_tokens=40, sampling=GREEDY, ignore_eos=True)
    plain, _ = _run(engine, req, None)
    # one-token matches: the random model's output repeats tokens more than n-grams
    drafted, gen = _run(engine, req, Speculation(PromptLookup(min_n=1), max_draft=8))
    assert drafted == plain and gen.loop.verifies > 0
