"""The reference engine against llama.cpp (llama-cpp-python) on the real SmolLM2 GGUF.

Two comparisons:
- on the shipped Q4_1 file: llama.cpp quantizes activations to Q8_1 inside its matmuls, so
  logits agree only approximately (measured: mean |diff| ~0.2, max ~1.9 on logits of
  magnitude ~30); we bound both and require the same top-1 token almost everywhere;
- on an F32 re-export of the same weights: llama.cpp then computes in float32 too, and the
  greedy continuations agree token for token for 32 tokens, logits within 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest

from stratad.engine.reference.forward import ReferenceForward
from stratad.store.loader import load_model
from tests.gguf_export import export_f32
from tests.greedy import greedy
from tests.llama_compare import llama_greedy, llama_logits

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
N_NEW = 32


def _llama(path: Path, f32_kv: bool = False) -> llama_cpp.Llama:
    kw = {"type_k": 0, "type_v": 0, "flash_attn": False} if f32_kv else {}
    return llama_cpp.Llama(
        str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0, **kw
    )


@pytest.fixture(scope="module")
def f32_copy(tmp_path_factory: pytest.TempPathFactory, smollm_path: Path) -> Path:
    dst = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    export_f32(smollm_path, dst)
    return dst


def test_quantized_file_logits_close(smollm_path: Path, smollm_forward: ReferenceForward) -> None:
    llm = _llama(smollm_path)
    agree = total = 0
    for text in PROMPTS:
        tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
        tokens += greedy(smollm_forward, tokens, 16)
        theirs = llama_logits(llm, tokens)
        ours = smollm_forward(tokens, smollm_forward.new_cache(256), all_logits=True)
        diff = (ours - theirs).abs()
        assert diff.mean() < 0.35, f"{text!r}: mean |logit diff| {diff.mean():.3f}"
        assert diff.max() < 3.0, f"{text!r}: max |logit diff| {diff.max():.3f}"
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(tokens)
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"


def test_f32_greedy_token_for_token(f32_copy: Path) -> None:
    model = load_model(f32_copy)
    forward = ReferenceForward(model)
    llm = _llama(f32_copy, f32_kv=True)
    for text in PROMPTS:
        prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
        ours = greedy(forward, prompt, N_NEW)
        theirs = llama_greedy(llm, prompt, N_NEW)
        assert ours == theirs, f"{text!r}: {llm.detokenize(ours)!r} != {llm.detokenize(theirs)!r}"
        tokens = prompt + ours
        diff = forward(tokens, forward.new_cache(256), all_logits=True) - llama_logits(llm, tokens)
        assert diff.abs().max() < 1e-2, f"{text!r}: max |logit diff| {diff.abs().max():.2e}"
