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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stratad.host_copy import to_device


def argmax_rows(rows: torch.Tensor) -> list[int]:
    """The index of the largest of each row [R, V] (the first of equals; a NaN counts as
    largest), as torch's argmax gives it. Host float32 logits go through numpy: torch's CPU
    argmax takes ~45 us over a 49k vocabulary, numpy's ~5 us, and greedy decoding pays it for
    every token. Logits on a device stay there: only the indices are copied, in one transfer."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        return [int(i) for i in rows.detach().numpy().argmax(1)]
    return [int(i) for i in rows.argmax(1).tolist()]


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

    @property
    def plain(self) -> bool:
        """Whether a draw needs nothing but the logits and the filters (no bias, penalties or
        log-probabilities): such rows of a step are drawn together (`draw_rows`)."""
        return not self.params.adjusts and self.params.logprobs is None

    def uniform(self) -> float:
        """This sequence's next uniform number in [0, 1): what a draw at temperature spends
        (none for a greedy one), so that a seeded request draws the same tokens alone or in
        a batch, with drafts or without."""
        return 0.0 if self.params.greedy else float(torch.rand(1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The filtered distribution [V] that `sample` draws from (logits already adjusted)."""
        return filtered(logits.float().cpu()[None], [self.params])[0].float()

    def draw(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> Sample:
        """logits [V] -> the next token; `allowed` [<= V] bool: the only tokens it may be."""
        p = self.params
        if self.plain and allowed is None:
            return Sample(drawn_token(draw_rows(logits[None], [p], [self.uniform()])[0]))
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
        token = drawn_token(draw_rows(scores[None], [p], [self.uniform()])[0])
        if p.logprobs is not None:
            logprob = float(logprobs[token])
        self._count(token, logits.numel())
        return Sample(token, logprob, top)

    def _count(self, token: int, vocab: int) -> None:
        if self.params.presence_penalty or self.params.frequency_penalty:
            if self.counts is None:
                self.counts = torch.zeros(vocab)
            self.counts[token] += 1

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        return self.draw(logits).token


def drawn_token(token: int | None) -> int:
    """A token `draw_rows` drew; raises for a row it could not draw from."""
    if token is None:
        raise ValueError("the logits give no distribution to draw from (NaN, or no token left)")
    return token


TOP_P_WIDTH = 1024  # the likeliest tokens a top-p cut is looked for among before a full sort


def filtered(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's filtered distribution: probabilities [R, V] float64 summing to 1 per row.
    The filters of each row's `params` in vLLM's order: temperature, then top-k (ties with
    the k-th kept), top-p (the smallest prefix of the likeliest tokens whose mass reaches it,
    ties with its last kept; the top token always is) and min-p (relative to the top
    token). Vectorised over the rows, on their device; no full sort of the vocabulary
    unless a row's top-p reaches past its `TOP_P_WIDTH` likeliest tokens."""
    return _filtered(scores, params, sort_whole=True)[0]


def _filtered(
    scores: torch.Tensor, params: Sequence[SamplingParams], sort_whole: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`filtered`, and whether a row's top-p cut lay past its `TOP_P_WIDTH` likeliest tokens
    ([] bool on the device). `sort_whole`: such rows are sorted whole (which asks the device
    whether there are any: the host waits); else they are not, and their distributions are
    wrong where the flag says so."""
    vocab = scores.shape[1]
    knobs = to_device([[max(p.temperature, 0.0), p.top_k, p.top_p, p.min_p] for p in params],
                      torch.float64, scores.device)  # fmt: skip
    temperature, top_k, top_p, min_p = knobs.unbind(1)
    x = scores.double()
    # shift before dividing: a tiny temperature sends the others to -inf, never inf - inf
    x = (x - x.max(1, keepdim=True).values) / temperature[:, None]
    ks = [p.top_k for p in params if 0 < p.top_k < vocab]
    if ks:
        k = top_k.long()
        kth = x.topk(max(ks), dim=1).values.gather(1, (k.clamp(1, max(ks)) - 1)[:, None])
        x = x.masked_fill(((k > 0) & (k < vocab))[:, None] & (x < kth), float("-inf"))
    probs = x.softmax(1)
    beyond = torch.zeros((), dtype=torch.bool, device=scores.device)
    if any(p.top_p < 1.0 for p in params):
        floor, beyond = _top_p_floor(probs, top_p, sort_whole)
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(p.min_p > 0.0 for p in params):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(1, keepdim=True).values, 0.0)
    return probs / probs.sum(1, keepdim=True), beyond


def _top_p_floor(
    probs: torch.Tensor, top_p: torch.Tensor, sort_whole: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, 1]: the least probability a row's top-p keeps (0 where top_p is 1), and whether a
    row's cut lay past its likeliest `TOP_P_WIDTH` ([] bool). The cut is looked for among
    those; with `sort_whole` the rows whose cut lies beyond are sorted whole."""
    width = min(probs.shape[1], TOP_P_WIDTH)
    ordered = probs.topk(width, dim=1).values
    beyond = torch.zeros((), dtype=torch.bool, device=probs.device)
    if width < probs.shape[1]:
        short = (ordered.sum(1) < top_p) & (top_p < 1.0)
        beyond = short.any()
        if sort_whole and bool(beyond):
            whole = probs.sort(dim=1, descending=True).values
            ordered = torch.where(short[:, None], whole, torch.nn.functional.pad(
                ordered, (0, probs.shape[1] - width)))  # fmt: skip
            beyond = torch.zeros_like(beyond)
    kept = (ordered.cumsum(1) - ordered < top_p[:, None]).sum(1, keepdim=True).clamp(min=1)
    floor = ordered.gather(1, kept - 1)
    return torch.where((top_p < 1.0)[:, None], floor, torch.zeros_like(floor)), beyond


def _kinds(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[list[int], list[int]]:
    """The greedy rows and the tempered ones of a step's draws (checked: a params and a
    uniform number per row of logits)."""
    rows = logits.shape[0]
    if len(params) != rows or len(uniforms) != rows:
        raise ValueError(f"{rows} rows of logits, {len(params)} params, {len(uniforms)} uniforms")
    greedy = [i for i, p in enumerate(params) if p.greedy]
    return greedy, [i for i, p in enumerate(params) if not p.greedy]


def _draw_tempered(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float],
    tempered: list[int], sort_whole: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rows `tempered` drawn at temperature by inverting the cumulative filtered distribution
    (in the vocabulary's order) at each row's uniform number: their tokens [R] and whether
    each had a distribution to draw from [R] (not where its filters leave none, as NaN logits
    do), on the device, and `_filtered`'s flag of a top-p cut past the rows it sorted."""
    device = logits.device
    if len(tempered) < logits.shape[0]:
        logits = logits.index_select(0, to_device(tempered, torch.long, device))
    probs, beyond = _filtered(logits, [params[i] for i in tempered], sort_whole)
    u = to_device([uniforms[i] for i in tempered], torch.float64, device)
    cdf = probs.cumsum(1)
    # the first token whose cumulative mass passes u (a token of zero mass never does)
    at = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    last = probs.shape[1] - 1 - (probs.flip(1) > 0).long().argmax(1, keepdim=True)
    at = torch.minimum(at, last)  # u * mass rounded up to the mass itself
    ok = torch.isfinite(cdf[:, -1:]) & (probs > 0).any(1, keepdim=True)
    return at[:, 0], ok[:, 0], beyond


def draw_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> list[int | None]:
    """The token drawn from each row of logits [R, V] (on any device) under its `params`:
    greedy rows their argmax (`argmax_rows`), the others by inverting the cumulative
    filtered distribution (`filtered`, in the vocabulary's order) at the row's uniform
    number. None for a row whose filters leave no distribution (NaN logits). One transfer
    to the host for every row: a step's rows are drawn together, not one synchronisation
    each."""
    rows = logits.shape[0]
    greedy, tempered = _kinds(logits, params, uniforms)
    out: list[int | None] = [None] * rows
    if greedy:
        ids = argmax_rows(logits[greedy] if len(greedy) < rows else logits)
        for i, t in zip(greedy, ids, strict=True):
            out[i] = t
    if tempered:
        at, ok, _ = _draw_tempered(logits, params, uniforms, tempered, sort_whole=True)
        tokens = torch.stack([at, ok.long()], 1).tolist()
        for i, (t, good) in zip(tempered, tokens, strict=True):
            out[i] = int(t) if good else None
    return out


@dataclass(frozen=True)
class DeviceDraw:
    """A step's draws left on the logits' device (`draw_on_device`), for the host to read
    later."""

    tokens: torch.Tensor  # [R] int64: each row's token (0 where `ok` is not)
    ok: torch.Tensor  # [R] bool: the row had a distribution to draw from
    # [] bool: a row's top-p cut lay past its `TOP_P_WIDTH` likeliest tokens, which this
    # draw does not sort: its tokens may be wrong, draw the rows again with `draw_rows`
    redo: torch.Tensor


def draw_on_device(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> DeviceDraw:
    """`draw_rows` with the tokens left on the device and no wait for it (the host can queue
    work on them before it reads them): the same token for every row, except that a top-p
    cut past a row's likeliest `TOP_P_WIDTH` tokens (a flat distribution) is not sorted
    whole but flagged (`DeviceDraw.redo`)."""
    rows = logits.shape[0]
    greedy, tempered = _kinds(logits, params, uniforms)
    if not tempered:
        ok = torch.ones(rows, dtype=torch.bool, device=logits.device)
        return DeviceDraw(logits.argmax(1), ok, torch.zeros_like(ok[0]))
    at, ok, redo = _draw_tempered(logits, params, uniforms, tempered, sort_whole=False)
    if not greedy:
        return DeviceDraw(torch.where(ok, at, torch.zeros_like(at)), ok, redo)
    device = logits.device
    g, t = to_device(greedy, torch.long, device), to_device(tempered, torch.long, device)
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)
    good = torch.ones(rows, dtype=torch.bool, device=device)
    tokens.index_copy_(0, g, logits.index_select(0, g).argmax(1))
    tokens.index_copy_(0, t, torch.where(ok, at, torch.zeros_like(at)))
    good.index_copy_(0, t, ok)
    return DeviceDraw(tokens, good, redo)
