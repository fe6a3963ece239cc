"""Greedy continuations and logits of Strata's reference engine and of llama.cpp
(`llama-cpp-python`), the comparisons the llama.cpp tests make."""

from __future__ import annotations

import llama_cpp
import numpy as np
import torch

from stratad.engine.reference.forward import ReferenceForward


def greedy(forward: ReferenceForward, prompt: list[int], n: int, context: int = 256) -> list[int]:
    """The reference engine's n greedy tokens after `prompt`."""
    cache = forward.new_cache(context)
    logits = forward(prompt, cache)[-1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = forward([out[-1]], cache)[-1]
    return out


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
