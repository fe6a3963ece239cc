"""Draft-model speculation: a model of the same vocabulary proposes greedy tokens, its cache
cut back to what the target kept; the same tokens as without drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels.cpu.experts import CpuExperts
from stratad.config import ConfigError, EngineConfig, parse_config
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest
from stratad.runtime.speculation.draft_model import (
    DraftModel,
    DraftModelError,
    DraftSequence,
    open_draft_model,
    vocabulary_mismatch,
)
from stratad.runtime.speculation.drafter import PromptLookup, propose_all
from stratad.runtime.speculation.settings import Speculation

GREEDY = SamplingParams(temperature=0.0)


def test_a_draft_of_another_vocabulary_is_refused_at_start(smollm_path: Path) -> None:
    with pytest.raises(DraftModelError, match="not the model's vocabulary"):
        open_draft_model(str(smollm_path), {"a": 0, "b": 1}, 2, 64, EngineConfig(threads=1))


def test_a_draft_needs_the_models_vocabulary() -> None:
    target = {f"t{i}": i for i in range(300)}
    assert vocabulary_mismatch(target, target) is None
    padded = {**target, **{f"pad{i}": 300 + i for i in range(100)}}  # within the slack
    assert vocabulary_mismatch(target, padded) is None
    assert vocabulary_mismatch(padded, target) is None
    other = {**target, "t7": 8, "t8": 7}
    assert "token 7" in str(vocabulary_mismatch(target, other))
    assert "tokens against" in str(vocabulary_mismatch(target, {"a": 0}))


def _draft(model: Model, capacity: int = 512) -> DraftModel:
    forward = ReferenceForward(model, weights=QuantWeights(CpuExperts(threads=2)))
    return DraftModel(forward, model.spec.vocab_size, capacity)


def test_a_proposal_after_a_miss_starts_from_the_kept_tokens(tiny_moe_model: Model) -> None:
    """The draft's cache keeps its drafts past what the target took; the next proposal cuts
    them and gives what a fresh start from the settled tokens gives."""
    drafter = _draft(tiny_moe_model)
    prompt = [5, 6, 7, 8, 9, 10] * 3
    seq = drafter.start(prompt)
    first = seq.propose(4)
    assert len(first) == 4 and seq.cache.length == len(prompt) + 3
    other = (first[1] + 1) % tiny_moe_model.spec.vocab_size
    seq.extend([first[0], other])  # the first draft stood, the second did not
    fresh = drafter.start([*prompt, first[0], other])
    assert isinstance(fresh, DraftSequence)
    assert seq.propose(3) == fresh.propose(3)
    assert seq.cache.tokens[: len(prompt) + 2] == [*prompt, first[0], other]


def test_sequences_of_one_draft_model_are_proposed_for_together(tiny_moe_model: Model) -> None:
    """One batched pass of the draft per position gives each sequence the tokens it gets
    alone; drafts of another kind beside them propose as they do alone."""
    drafter = _draft(tiny_moe_model)
    prompts = [[5, 6, 7, 8, 9, 10] * 2, [11, 12, 13] * 3, [20, 21]]
    alone = [drafter.start(p).propose(k) for p, k in zip(prompts, (3, 1, 2), strict=True)]
    lookup = PromptLookup().start([1, 2, 3, 1, 2])
    asks = [(drafter.start(p), k) for p, k in zip(prompts, (3, 1, 2), strict=True)]
    got = propose_all([asks[0], (lookup, 2), asks[1], asks[2]])
    assert got == [alone[0], [3, 1], alone[1], alone[2]]
    assert [len(a) for a in alone] == [3, 1, 2]


class _Failing:
    """A drafter whose proposals raise."""

    def start(self, prompt: list[int], scope: str = "") -> _Failing:
        return self

    def extend(self, tokens: list[int]) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        raise RuntimeError("the drafter broke")


def test_a_failing_drafter_drafts_nothing(tiny_moe_model: Model) -> None:
    forward = ReferenceForward(tiny_moe_model, weights=QuantWeights(CpuExperts(threads=2)))
    req = GenerationRequest([5, 6, 7, 8, 9, 10] * 2, 6, GREEDY, ignore_eos=True)
    plain = [e.token for e in _generator(forward, tiny_moe_model, None).run(req)]
    gen = _generator(forward, tiny_moe_model, Speculation(_Failing(), max_draft=2))
    assert [e.token for e in gen.run(req)] == plain
    assert gen.loop.drafted == 0


def _generator(forward: ReferenceForward, model: Model, spec: Speculation | None) -> Generator:
    return Generator(forward, tokenizer_from_gguf(model.metadata), 512, prefill_chunk=64,
                     speculation=spec)  # fmt: skip


def test_greedy_tokens_with_the_model_as_its_own_draft(
    smollm_model: Model, smollm_path: Path
) -> None:
    """The default model drafting for itself: every draft it makes is the token the target
    takes (the cpu engine's bits do not depend on the pass), and the answer is the one
    without drafts."""
    forward = ReferenceForward(smollm_model, weights=QuantWeights(CpuExperts(threads=2)))
    tokenizer = tokenizer_from_gguf(smollm_model.metadata)
    req = GenerationRequest(tokenizer.encode("Name three colours."), 20, GREEDY,
                            ignore_eos=True)  # fmt: skip
    plain = [e.token for e in _generator(forward, smollm_model, None).run(req)]
    vocab, size = tokenizer.hf.get_vocab(), smollm_model.spec.vocab_size
    draft = open_draft_model(str(smollm_path), vocab, size, 512, EngineConfig(threads=2))
    spec = Speculation.from_config("draft_model", 4, 0.2, "cpu", draft)
    assert spec is not None and spec.drafter is draft
    gen = _generator(forward, smollm_model, spec)
    assert [e.token for e in gen.run(req)] == plain
    assert gen.loop.verifies > 0 and gen.loop.accepted == gen.loop.drafted > 0


def test_greedy_tokens_are_those_without_drafts_on_the_tiny_moe(tiny_moe_model: Model) -> None:
    forward = ReferenceForward(tiny_moe_model, weights=QuantWeights(CpuExperts(threads=2)))
    req = GenerationRequest([5, 6, 7, 8, 9, 10] * 4, 16, GREEDY, ignore_eos=True)
    plain = [e.token for e in _generator(forward, tiny_moe_model, None).run(req)]
    gen = _generator(forward, tiny_moe_model, Speculation(_draft(tiny_moe_model), max_draft=3))
    assert [e.token for e in gen.run(req)] == plain
    assert gen.loop.verifies > 0


def test_draft_model_is_a_setting_that_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="model.draft"):
        parse_config('[speculation]\ndrafter = "draft_model"\n')
    config = parse_config('[model]\ndraft = "small.gguf"\n[speculation]\ndrafter = "draft_model"\n')
    assert config.model.draft == "small.gguf"
    with pytest.raises(ValueError, match="model.draft"):
        Speculation.from_config("draft_model", 4, 0.2, "cpu")
