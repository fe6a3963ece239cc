"""The generation loop on the default model: stops, limits, EOS, seeds, prefix reuse."""

from __future__ import annotations

import pytest

from stratad.engine.reference.forward import ReferenceForward
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime.generate import Generator
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def gen(smollm_model, smollm_forward: ReferenceForward) -> Generator:  # type: ignore[no-untyped-def]
    return Generator(smollm_forward, tokenizer_from_gguf(smollm_model.metadata), max_context=512)


def _chat(gen: Generator, text: str) -> list[int]:
    prompt = gen.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return gen.tokenizer.encode(prompt, add_special=False)


def _text(gen: Generator, req: GenerationRequest) -> tuple[str, str | None, int]:
    events = list(gen.run(req))
    return "".join(e.text for e in events), events[-1].finish_reason, len(events)


def test_eos_stops(gen: Generator) -> None:
    text, reason, n = _text(
        gen,
        GenerationRequest(
            _chat(gen, "What is the capital of France?"), max_tokens=64, sampling=GREEDY
        ),
    )
    assert text == "The capital of France is Paris."
    assert reason == "stop" and n < 64


def test_max_tokens(gen: Generator) -> None:
    text, reason, n = _text(
        gen, GenerationRequest(_chat(gen, "Tell me a long story."), max_tokens=5, sampling=GREEDY)
    )
    assert reason == "length" and n == 5 and text


def test_stop_string_is_cut(gen: Generator) -> None:
    full, _, _ = _text(
        gen,
        GenerationRequest(
            _chat(gen, "What is the capital of France?"), max_tokens=64, sampling=GREEDY
        ),
    )
    text, reason, _ = _text(
        gen,
        GenerationRequest(
            _chat(gen, "What is the capital of France?"),
            max_tokens=64,
            sampling=GREEDY,
            stop=("France",),
        ),
    )
    assert reason == "stop" and text == full[: full.index("France")]


def test_seeded_sampling_reproducible(gen: Generator) -> None:
    req = GenerationRequest(
        _chat(gen, "Name a fruit."),
        max_tokens=12,
        sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=42),
    )
    assert _text(gen, req) == _text(gen, req)


def test_prefix_reuse_same_tokens(gen: Generator, smollm_forward: ReferenceForward) -> None:
    prompt = _chat(gen, "Write a haiku about the sea.")
    first = _text(gen, GenerationRequest(prompt, max_tokens=16, sampling=GREEDY))
    assert gen.cache.common_prefix(prompt) == len(prompt)  # the KV of the prompt is kept
    again = _text(gen, GenerationRequest(prompt, max_tokens=16, sampling=GREEDY))
    assert first == again


def test_prompt_too_long(gen: Generator) -> None:
    with pytest.raises(ValueError, match="does not fit the context of 512"):
        list(gen.run(GenerationRequest([1] * 600)))


def test_a_step_draws_its_tokens_together_as_each_would_alone(
    smollm_model, smollm_forward: ReferenceForward  # type: ignore[no-untyped-def]
) -> None:
    """Three requests in one loop (greedy, seeded top-p, seeded top-k with min-p) draw their
    tokens in one `draw_rows` a step, and each gets the tokens it gets run alone: a row's
    draw depends on its own logits, filters and seed only."""
    together = Generator(smollm_forward, tokenizer_from_gguf(smollm_model.metadata),
                         max_context=256, parallel=3)  # fmt: skip
    prompt = _chat(together, "Name three colours.")
    reqs = [GenerationRequest(prompt, max_tokens=6, sampling=s) for s in (
        GREEDY, SamplingParams(temperature=1.2, top_p=0.9, seed=5),
        SamplingParams(temperature=0.8, top_k=20, min_p=0.05, seed=9))]  # fmt: skip
    seqs = [together.start(r) for r in reqs]
    got: dict[int, list[int]] = {id(s): [] for s in seqs}
    while together.loop.running:
        for s, outcome in together.step():
            assert not isinstance(outcome, Exception)
            got[id(s)].append(outcome.token)  # type: ignore[union-attr]
    for s in seqs:
        together.finish(s)
    alone = [[e.token for e in together.run(r)] for r in reqs]
    assert [got[id(s)] for s in seqs] == alone
    assert alone[1] != alone[0] or alone[2] != alone[0]  # the tempered ones drew, not argmax
