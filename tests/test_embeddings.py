"""Embeddings: `POST /v1/embeddings` on the default model (SmolLM2-135M-Instruct, the cpu
engine) through the real `openai` client, and the pooling itself on the torch reference
engine, both against llama.cpp's own embeddings of the same GGUF (llama-cpp-python,
`embedding=True` with the same pooling): kernels round differently, so the vectors are compared
by cosine. Measured: 0.9995 and up; the vectors of different texts here are 0.44 to 0.79
apart, and llama.cpp's last-token vectors 0.49 to 0.94 from its mean ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import openai
import pytest

from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import load_tokenizer
from stratad.runtime.generate import Generator
from stratad.runtime.pooling import PooledEvent, PoolingRequest
from stratad.runtime.sampling import SamplingParams
from stratad.runtime.sequence import GenerationRequest
from tests.server_helpers import Daemon, shared_daemon

MODEL = "default"
WIDTH = 576  # SmolLM2-135M's hidden size
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Paris is the capital of France.",
]
SAME = 0.998  # cosine with llama.cpp's vector of the same text and pooling
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("default")


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return daemon.client()


def _llama(path: Path, pooling: str) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(path), embedding=True, pooling_type=POOLING[pooling], n_ctx=256,
                           n_threads=2, verbose=False)  # fmt: skip


def _llama_vectors(path: Path, pooling: str) -> np.ndarray:
    llm = _llama(path, pooling)
    return np.array([llm.embed(t, normalize=True) for t in TEXTS])


def _vectors(answer: Any) -> np.ndarray:
    return np.array([d.embedding for d in answer.data], dtype=np.float64)


def _error(daemon: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, raw = daemon.post("/v1/embeddings", json.dumps(body).encode())
    answer = json.loads(raw)
    return status, answer["error"] if status >= 400 else answer


def test_vectors_are_llama_cpps(client: openai.OpenAI, smollm_path: Path) -> None:
    """A list of texts: one unit vector of the model's width per text, in order, each llama.cpp's
    mean-pooled embedding of it; usage counts the inputs' tokens."""
    answer = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert answer.object == "list" and answer.model
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    assert all(d.object == "embedding" for d in answer.data)
    ours = _vectors(answer)
    assert ours.shape == (len(TEXTS), WIDTH)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosines = (ours * _llama_vectors(smollm_path, "mean")).sum(1)
    assert (cosines > SAME).all(), cosines
    singles = [client.embeddings.create(model=MODEL, input=t) for t in TEXTS]
    assert answer.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles) > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens


def test_float_base64_batch_and_repeat_agree(client: openai.OpenAI, daemon: Daemon) -> None:
    """The float and base64 answers carry the same float32 values; a text embedded alone, in a
    batch, again, or as its token ids gets the same vector."""
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert isinstance(floats.data[0].embedding[0], float)
    batch = _vectors(floats)
    assert np.array_equal(batch, _vectors(client.embeddings.create(model=MODEL, input=TEXTS)))
    alone = np.concatenate(
        [_vectors(client.embeddings.create(model=MODEL, input=t, encoding_format="float"))
         for t in TEXTS])  # fmt: skip
    np.testing.assert_allclose(alone, batch, atol=1e-6)
    again = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert np.array_equal(_vectors(again)[0], alone[1])
    _, tokens = daemon.post("/tokenize", json.dumps({"prompt": TEXTS[2]}).encode())
    ids = json.loads(tokens)["tokens"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(_vectors(by_ids)[0], alone[2], atol=1e-6)
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    one = client.embeddings.create(model=MODEL, input=ids, dimensions=WIDTH)
    np.testing.assert_allclose(_vectors(one)[0], alone[2], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "input must have at least 1"),
        ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
        ({"input": []}, "input", "input must have at least 1"),
        ({"input": ["a", [1, 2]]}, "input", "input must be a string, a list of strings"),
        ({"input": [[]]}, "input[0]", "input[0] must have at least 1"),
        ({"input": ["a"] * 2049}, "input", "input has 2049 items; at most 2048"),
        ({"input": [49152]}, "input", "the input has token id 49152"),
        ({}, "input", "input is required"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "encoding_format may not"),
        ({"input": "a", "dimensions": 64}, "dimensions", "dimensions=64 cannot be served"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be at least 1"),
    ],
)
def test_400_in_our_words(daemon: Daemon, body: dict[str, Any], param: str, words: str) -> None:
    status, err = _error(daemon, body)
    assert status == 400 and err["param"] == param, err
    assert err["message"].startswith(words), err
    assert err["type"] == "invalid_request_error", err


def test_longer_than_the_context(daemon: Daemon) -> None:
    context = json.loads(daemon.get("/v1/models")[1])["data"][0]["max_model_len"]
    status, err = _error(daemon, {"input": [5] * (context + 1)})
    assert status == 400 and err["code"] == "context_length_exceeded", err
    assert err["param"] == "input" and f"the context holds {context}" in err["message"], err
    status, err = _error(daemon, {"input": ["a", "word " * (2 * context)]})
    assert status == 400 and err["code"] == "context_length_exceeded", err


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert info.value.code == "model_not_found"


def _beside(gen: Generator, prompt: list[int], tokens: list[int], pooling: str
            ) -> tuple[list[int], list[Any]]:  # fmt: skip
    """A greedy generation of `prompt` and the pooling of `tokens`, in the same steps: the
    generated tokens and the pooling's events."""
    greedy = GenerationRequest(prompt, max_tokens=6, sampling=SamplingParams(0.0))
    beside = gen.start(greedy)
    pooled = gen.pool(PoolingRequest(tokens, pooling))  # type: ignore[arg-type]
    got: dict[object, list[Any]] = {beside: [], pooled: []}
    while gen.loop.running:
        for s, event in gen.step():
            got[s].append(event)
    assert pooled.cache.tokens == tokens  # its KV stays for a later prompt that starts so
    gen.finish(beside)
    gen.finish(pooled)
    return [e.token for e in got[beside]], got[pooled]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_reference_engine_pools_as_llama_cpp(
    smollm_model: Model, smollm_forward: ReferenceForward, smollm_path: Path, pooling: str
) -> None:
    """The step loop on the torch reference: each text pooled over prompt chunks of 4 tokens,
    beside a generating request on the other working cache, is llama.cpp's vector of the same
    pooling, and the generation's tokens are those it makes alone."""
    tokenizer = load_tokenizer(smollm_model)
    gen = Generator(smollm_forward, tokenizer, 64, prefill_chunk=4, parallel=2)
    prompt = tokenizer.encode("Once upon a time", add_special=True)
    greedy = GenerationRequest(prompt, max_tokens=6, sampling=SamplingParams(0.0))
    alone = [e.token for e in gen.run(greedy)]
    ours = []
    for text in TEXTS:
        generated, events = _beside(gen, prompt, tokenizer.encode(text, add_special=True), pooling)
        assert generated == alone
        assert len(events) == 1 and isinstance(events[0], PooledEvent), events
        ours.append(events[0].vector.double().numpy())
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosines = (np.array(ours) * _llama_vectors(smollm_path, pooling)).sum(1)
    assert (cosines > SAME).all(), cosines
    with pytest.raises(ValueError, match="65 tokens does not fit the context of 64"):
        gen.pool(PoolingRequest([5] * 65))
    gen.finish(gen.pool(PoolingRequest([5] * 64)))  # the whole context is the most
