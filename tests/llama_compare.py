"""Greedy continuations and logits of Strata's reference engine and of llama.cpp
(`llama-cpp-python`), the comparisons the llama.cpp tests make."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import torch

from stratad.engine.reference.forward import ReferenceForward
from tests.greedy import greedy


def llama_greedy(llm: llama_cpp.Llama, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's n greedy tokens after `prompt` (from a reset context)."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def llama_logits(llm: llama_cpp.Llama, tokens: list[int]) -> torch.Tensor:
    """llama.cpp's logits [T, V] of every token (the context built with logits_all)."""
    llm.reset()
    llm.eval(tokens)
    return torch.tensor(np.array(llm.scores[: len(tokens)]))


def f32_llama(path: Path, context: int = 128) -> llama_cpp.Llama:
    """llama.cpp on the CPU keeping float32 end to end (F32 KV, no flash attention)."""
    return llama_cpp.Llama(str(path), n_gpu_layers=0, n_ctx=context, logits_all=True,
                           verbose=False, n_threads=2, seed=0, type_k=0, type_v=0,
                           flash_attn=False)  # fmt: skip


def assert_as_llama(forward: ReferenceForward, path: Path, prompts: list[str], n: int) -> None:
    """On an F32 file: llama.cpp's n greedy tokens after each prompt, and the logits of the
    prompt and them within 1e-3."""
    llm = f32_llama(path)
    for text in prompts:
        prompt = llm.tokenize(text.encode(), add_bos=False)
        ours = greedy(forward, prompt, n)
        assert ours == llama_greedy(llm, prompt, n), text
        tokens = prompt + ours
        logits = forward(tokens, forward.new_cache(128), all_logits=True)
        diff = (logits - llama_logits(llm, tokens)).abs().max()
        assert diff < 1e-3, f"{text!r}: max |logit diff| {diff:.2e}"
