"""Turning logits into the next token: greedy, or temperature with top-k, top-p and min-p.

The filters run in vLLM's order: temperature first, then top-k, top-p and min-p on the
tempered distribution. A seed makes a request reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Sampler:
    """Samples from one sequence's logits; owns that sequence's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The filtered distribution [V] that `sample` draws from."""
        p = self.params
        logits = logits.float().cpu()
        # Shift before dividing: a tiny temperature then sends the others to -inf, never
        # inf - inf (NaN); the top token always keeps its mass.
        scores = (logits - logits.max()) / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = scores.topk(p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            probs = probs.scatter(0, order[drop], 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        if self.params.greedy:
            return int(logits.argmax())
        probs = self.probabilities(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator))
