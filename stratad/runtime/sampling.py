"""Turning logits into the next token: greedy, or temperature with top-k, top-p and min-p.

Before any filter the logits are adjusted as OpenAI's API defines: `logit_bias` added, then
the presence and frequency penalties over the tokens this sequence generated so far
(`mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty`). Log-probabilities, when
asked for, are of that adjusted distribution at temperature 1. A grammar's mask of allowed
tokens (structured output) comes last, then the filters run in vLLM's order: temperature
first, then top-k, top-p and min-p on the tempered distribution. A seed makes a request
reproducible.

A drafted token (speculative decoding) asks nothing of the sampler: the token drawn at its
position, as if there were no draft, stands for it where the two are equal. Greedy: the
draft stands if it is the argmax. Sampling: it stands with probability p(d), and otherwise
the token drawn is a draw from p without d, renormalised: for a draft that is a point mass,
the rejection step of speculative sampling (Leviathan et al., Chen et al.), keeping the
model's distribution exactly, and coupled so that a seeded request draws the same tokens with
drafts or without (one draw per position either way, whatever the drafts' lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def argmax(logits: torch.Tensor) -> int:
    """The index of the largest of `logits` (the first of equals; a NaN counts as largest), as
    torch's argmax gives it. Host float32 logits go through numpy: torch's CPU argmax takes
    ~45 us over a 49k vocabulary, numpy's ~5 us, and greedy decoding pays it for every token.
    Logits on a device stay there: only the index is copied."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: the chosen token's and the k likeliest

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before sampling (bias or penalties)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class Sample:
    """A drawn token, with its log-probability and the likeliest alternatives if asked."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


class Sampler:
    """Samples from one sequence's logits; owns that sequence's random generator and the
    counts of the tokens it generated (for the penalties)."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.counts: torch.Tensor | None = None  # [V] times each token was generated

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with `logit_bias` and the penalties applied, float32 on the CPU."""
        p = self.params
        scores = logits.float().cpu()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < scores.numel()], dtype=torch.long)
            bias = torch.tensor([b for t, b in p.logit_bias if t < scores.numel()])
            scores = scores.index_add(0, ids, bias)
        if self.counts is not None and (p.presence_penalty or p.frequency_penalty):
            counts = self.counts[: scores.numel()]
            scores = scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        return scores

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The filtered distribution [V] that `sample` draws from (logits already adjusted)."""
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

    def draw(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> Sample:
        """logits [V] -> the next token; `allowed` [<= V] bool: the only tokens it may be."""
        p = self.params
        if not p.adjusts and allowed is None and p.logprobs is None and p.greedy:
            token = argmax(logits)
        else:
            scores = self.adjusted(logits)
            logprob: float | None = None
            top: tuple[tuple[int, float], ...] = ()
            if p.logprobs is not None:
                logprobs = scores.log_softmax(-1)
                if p.logprobs:
                    values, ids = logprobs.topk(min(p.logprobs, logprobs.numel()))
                    top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            if allowed is not None:
                mask = torch.zeros(scores.numel(), dtype=torch.bool)
                n = min(allowed.numel(), scores.numel())
                mask[:n] = allowed[:n]
                scores = scores.masked_fill(~mask, float("-inf"))
            if p.greedy:
                token = argmax(scores)
            else:
                probs = self.probabilities(scores)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
            if p.logprobs is not None:
                logprob = float(logprobs[token])
            self._count(token, logits.numel())
            return Sample(token, logprob, top)
        self._count(token, logits.numel())
        return Sample(token)

    def _count(self, token: int, vocab: int) -> None:
        if self.params.presence_penalty or self.params.frequency_penalty:
            if self.counts is None:
                self.counts = torch.zeros(vocab)
            self.counts[token] += 1

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        return self.draw(logits).token
