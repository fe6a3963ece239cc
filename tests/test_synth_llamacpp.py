"""Strata's reference engine against llama.cpp on a synthetic model in llama-quantize's Q4_K_M mix.

tiny-moe --ftype q4_k_m holds Q4_K, Q5_K, Q6_K, Q8_0 and Q5_0 tensors. Two comparisons, as in
tests/test_llamacpp.py:
- exact: Strata reads the q4_k_m file with its own dequantizers; llama.cpp runs an F32 copy
  dequantized by gguf-py (an independent port of llama.cpp's dequantize_row_*), so both
  compute in float32 on the same values: greedy continuations agree token for token for 16
  tokens, logits within 1e-3 (measured 1.3e-5). A dequantizer of Strata's off by one
  rounding shows here.
- approximate: llama.cpp runs the q4_k_m file itself, quantizing activations to 8 bits inside
  its matmuls. A random model's top two logits are often closer than that error (margins of
  0.006 against differences of ~0.04 measured), so greedy runs part ways within 16 tokens; on
  the same tokens the logits must stay close and agree on the top-1 almost everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gguf_quants

from kernels.formats.quant import SUPPORTED_QTYPES
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.synthetic import writer as synth
from stratad.store.loader import load_model
from tests.gguf_scan import ScannedTensor, scan, tensor_bytes
from tests.greedy import greedy
from tests.llama_compare import f32_llama, llama_greedy, llama_logits
from tests.synth_rewrite import rewrite

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
N_NEW = 16
PRESET = synth.PRESETS["tiny-moe"]


def _f32_copy_by_gguf_py(src: Path, dst: Path) -> None:
    """`src` with every tensor dequantized to F32 by gguf-py, not by Strata's kernels."""

    def f32(t: ScannedTensor) -> np.ndarray:
        raw = np.asarray(tensor_bytes(src, t))
        values = gguf_quants.dequantize(raw.reshape(int(np.prod(t.shape[:-1])), -1), t.qtype)
        return values.reshape(t.shape).astype(np.float32)

    rewrite(PRESET, dst, ((t.name, f32(t)) for t in scan(src)[1]))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("synth-q4km")
    q4km, f32 = folder / "tiny-moe-q4_k_m.gguf", folder / "tiny-moe-f32.gguf"
    synth.write_synth(PRESET, q4km, ftype=synth.get_ftype("q4_k_m"))
    _f32_copy_by_gguf_py(q4km, f32)
    return q4km, f32


def test_reference_engine_against_llama_cpp(files: tuple[Path, Path]) -> None:
    q4km, f32 = files
    held = {t.qtype for t in scan(q4km)[1]}
    assert held <= SUPPORTED_QTYPES, held - SUPPORTED_QTYPES
    forward = ReferenceForward(load_model(q4km))
    # F32 KV cache and no flash attention: llama.cpp keeps float32 end to end on F32 weights
    exact, quantized = f32_llama(f32, 256), f32_llama(q4km, 256)
    agree = total = 0
    for text in PROMPTS:
        prompt = exact.tokenize(text.encode(), add_bos=False, special=True)
        ours = greedy(forward, prompt, N_NEW)
        theirs = llama_greedy(exact, prompt, N_NEW)
        assert ours == theirs, f"{text!r}: {ours} != {theirs}"
        tokens = prompt + ours
        logits = forward(tokens, forward.new_cache(256), all_logits=True)
        diff = (logits - llama_logits(exact, tokens)).abs()
        assert diff.max() < 1e-3, f"{text!r}: max |logit diff| {diff.max():.2e} on F32"
        # The quantized file in llama.cpp: measured mean 0.04, max 0.31 on logits of std 4,
        # top-1 agreement 95%.
        diff = logits - (theirs_q := llama_logits(quantized, tokens))
        assert diff.abs().mean() < 0.1, f"{text!r}: mean |logit diff| {diff.abs().mean():.3f}"
        assert diff.abs().max() < 1.0, f"{text!r}: max |logit diff| {diff.abs().max():.3f}"
        agree += int((logits.argmax(-1) == theirs_q.argmax(-1)).sum())
        total += len(tokens)
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
