"""The generation loop on the default model: stops, limits, EOS, seeds, prefix reuse."""

from __future__ import annotations

import pytest

from stratad.engine.reference.forward import ReferenceForward
from stratad.model.tokenizer_build import tokenizer_from_gguf
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
