"""Greedy continuations of a prompt through any engine with the ReferenceForward interface
(`forward(tokens, cache)` -> logits, `forward.new_cache(n)`), the tests' common way to compare
engines token for token."""

from __future__ import annotations

from typing import Any

import torch


def greedy_logits(
    forward: Any, prompt: list[int], n: int, context: int = 128
) -> tuple[list[int], torch.Tensor]:
    """(n greedy tokens after `prompt`, the logits after the last of them) in a cache of
    `context` positions."""
    cache = forward.new_cache(context)
    logits = forward(prompt, cache)[-1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = forward([out[-1]], cache)[-1]
    return out, logits


def greedy(forward: Any, prompt: list[int], n: int, context: int = 256) -> list[int]:
    """n greedy tokens after `prompt`."""
    return greedy_logits(forward, prompt, n, context)[0]
