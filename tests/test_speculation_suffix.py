"""Suffix decoding: drafts from the sequence's own text, else from what most often followed
its last tokens in the recent answers of its scope; the same tokens as without drafts."""

from __future__ import annotations

import pytest

from kernels.cpu.experts import CpuExperts
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest
from stratad.runtime.speculation.settings import Speculation
from stratad.runtime.speculation.suffix import Answers, SuffixDecoding

GREEDY = SamplingParams(temperature=0.0)


def test_the_most_frequent_continuation_while_it_holds_its_share() -> None:
    answers = Answers(min_n=2, max_n=3, budget=100)
    for tail in ([8], [8], [9]):  # after 1 2 3: 4 7, then 8 twice and 9 once
        answers.add(None, [1, 2, 3, 4, 7, *tail])
    assert answers.propose([1, 2, 3], 5, min_share=0.5) == [4, 7, 8]
    assert answers.propose([1, 2, 3], 5, min_share=0.7) == [4, 7]  # 8: 2 of 3 after 4 7
    assert answers.propose([0, 2, 3], 5, min_share=0.5) == [4, 7]  # as many as matched
    assert answers.propose([5, 6], 5, min_share=0.1) == []  # never seen
    assert answers.propose([2, 3], 1, min_share=0.5) == [4]


def test_the_oldest_answers_go_past_the_budget_and_take_their_counts() -> None:
    answers = Answers(min_n=1, max_n=2, budget=6)
    first = answers.add(None, [1, 2, 3])
    answers.add(None, [4, 5, 6])
    assert answers.propose([1, 2], 2, 0.5) == [3]
    answers.add(None, [7])  # 7 tokens: the first answer goes
    assert first.dropped and answers.propose([1, 2], 2, 0.5) == []
    assert answers.propose([4, 5], 2, 0.5) == [6]
    kept = Answers(min_n=1, max_n=2, budget=6)
    kept.add(None, [4, 5, 6])
    kept.add(None, [7])
    assert answers.follow == kept.follow  # exactly the kept answers' counts
    # an answer dropped while its sequence still runs goes on as a new one
    again = answers.add(first, [8, 9])
    assert again is not first and answers.propose([8], 1, 0.5) == [9]


def test_scopes_do_not_see_each_others_answers() -> None:
    drafter = SuffixDecoding(min_n=1, max_n=2)
    mine = drafter.start([100], scope="a")
    mine.extend([1, 2, 3, 4])
    assert drafter.start([1, 2], scope="a").propose(3) == [3, 4]
    assert drafter.start([1, 2], scope="b").propose(3) == []
    # the longer match wins; its own text's on a tie (the latest earlier occurrence)
    assert drafter.start([1, 9, 9, 1], scope="a").propose(2) == [9, 9]
    assert drafter.start([2, 9, 1, 2], scope="a").propose(2) == [3, 4]
    few = SuffixDecoding(scopes=1)
    few.start([1], scope="a").extend([1, 2, 3])
    few.start([1], scope="b")  # the least recently used scope goes
    assert few.start([1, 2], scope="a").propose(1) == []
    for bad in ({"min_n": 3, "max_n": 2}, {"min_share": 0.0}, {"budget": 0}):
        with pytest.raises(ValueError):
            SuffixDecoding(**bad)  # type: ignore[arg-type]


def _generator(forward: ReferenceForward, model: Model, spec: Speculation | None) -> Generator:
    return Generator(forward, tokenizer_from_gguf(model.metadata), 512, prefill_chunk=64,
                     speculation=spec)  # fmt: skip


def test_an_answer_given_again_is_drafted_from_the_first(smollm_model: Model) -> None:
    """A request with nothing to copy from its prompt, made again (a retry, an agent's loop):
    after the first answer, the drafter proposes that answer for the same prompt of the same
    scope, not of another; the answers are the same tokens as without drafts. (What the
    proposals are is checked directly: how many the loop verifies depends on its measured
    step times.)"""
    forward = ReferenceForward(smollm_model, weights=QuantWeights(CpuExperts(threads=2)))
    tokenizer = tokenizer_from_gguf(smollm_model.metadata)
    prompt = tokenizer.encode("Write two sentences about the sea.")
    req = GenerationRequest(prompt, max_tokens=32, sampling=GREEDY, ignore_eos=True)
    plain = [e.token for e in _generator(forward, smollm_model, None).run(req)]
    drafter = SuffixDecoding()
    gen = _generator(forward, smollm_model, Speculation(drafter, max_draft=8))
    again = GenerationRequest(prompt, 32, GREEDY, ignore_eos=True, scope="a")
    # 8 tokens into the answer: an 8-token context of the first answer, 8 tokens drafted
    tail, rest = prompt + plain[:8], plain[8:16]
    assert drafter.start(tail, scope="a").propose(8) != rest  # nothing yet
    assert [e.token for e in gen.run(again)] == plain
    assert drafter.start(tail, scope="a").propose(8) == rest
    assert drafter.start(tail, scope="b").propose(8) != rest
    before = gen.loop.accepted
    assert [e.token for e in gen.run(again)] == plain
    assert gen.loop.accepted > before


def test_greedy_tokens_are_those_without_drafts_on_the_tiny_moe(tiny_moe_model: Model) -> None:
    forward = ReferenceForward(tiny_moe_model, weights=QuantWeights(CpuExperts(threads=2)))
    req = GenerationRequest([5, 6, 7, 8, 9, 10] * 4, 24, GREEDY, ignore_eos=True)
    plain = [e.token for e in _generator(forward, tiny_moe_model, None).run(req)]
    gen = _generator(forward, tiny_moe_model,
                     Speculation(SuffixDecoding(min_n=1), max_draft=8))  # fmt: skip
    for _ in range(2):
        assert [e.token for e in gen.run(req)] == plain
    assert gen.loop.verifies > 0 and gen.loop.accepted > 0


def test_suffix_is_a_setting() -> None:
    spec = Speculation.from_config("suffix", 6, 0.2, "offload")
    assert spec is not None and isinstance(spec.drafter, SuffixDecoding)
