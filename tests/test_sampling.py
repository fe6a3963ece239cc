"""Sampling filters against their definitions, and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from stratad.runtime.sampling import Sampler, SamplingParams, argmax_rows

LOGITS = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])


def test_greedy_is_argmax() -> None:
    assert Sampler(SamplingParams(temperature=0.0)).sample(LOGITS) == 0
    assert Sampler(SamplingParams(temperature=5.0, top_k=1)).sample(LOGITS) == 0


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 3.0, 3.0, 2.0],  # equals: the first
        [1.0, float("nan"), 3.0, float("nan")],  # a NaN counts as largest
        [float("-inf")] * 3,
        [-0.0, 0.0, -1.0],
    ],
)
def test_argmax_is_torchs(values: list[float]) -> None:
    x = torch.tensor(values)
    assert argmax_rows(x[None]) == [int(x.argmax())]


def test_argmax_of_a_vocabulary_and_of_views() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 49152, generator=g).round(decimals=1)  # many equal maxima
    for x in (rows[1], rows[:, 7], rows.double()[2], rows.half()[0]):
        assert argmax_rows(x[None]) == [int(x.argmax())]


def test_top_k_keeps_k() -> None:
    p = Sampler(SamplingParams(top_k=3)).probabilities(LOGITS)
    assert (p > 0).sum() == 3 and torch.allclose(p[:3], LOGITS[:3].softmax(-1))


def test_top_p_smallest_prefix() -> None:
    full = LOGITS.softmax(-1)
    p = Sampler(SamplingParams(top_p=0.8)).probabilities(LOGITS)
    # the first two tokens hold 0.63+0.23 = 0.87 >= 0.8, the first alone does not
    assert full[0] < 0.8 <= full[:2].sum()
    assert (p > 0).tolist() == [True, True, False, False, False, False]


def test_min_p_relative_to_max() -> None:
    p = Sampler(SamplingParams(min_p=0.3)).probabilities(LOGITS)
    full = LOGITS.softmax(-1)
    assert ((p > 0) == (full >= 0.3 * full.max())).all()


def test_temperature_sharpens() -> None:
    cold = Sampler(SamplingParams(temperature=0.5)).probabilities(LOGITS)
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(LOGITS)
    assert cold[0] > LOGITS.softmax(-1)[0] > hot[0]


def test_seed_reproducible_and_distribution() -> None:
    a = [Sampler(SamplingParams(seed=7)).sample(LOGITS) for _ in range(3)]
    assert len(set(a)) == 1
    s = Sampler(SamplingParams(seed=1))
    draws = torch.tensor([s.sample(LOGITS) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=6).float() / 4000
    assert (freq - LOGITS.softmax(-1)).abs().max() < 0.03


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0), dict(top_k=-1)],
)
def test_invalid_params(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**bad))  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [1e-30, 1e-8])
def test_tiny_temperature_is_argmax_not_nan(temperature: float) -> None:
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=1e-30, seed=0))
    probs = sampler.probabilities(LOGITS * 1e3)
    assert torch.isfinite(probs).all() and probs[0] == 1.0
    assert sampler.sample(LOGITS) == 0


def test_logit_bias_adds_before_sampling() -> None:
    # -100 removes the argmax, +100 forces a token, as OpenAI's docs describe
    banned = Sampler(SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)))
    assert banned.sample(LOGITS) == 1
    forced = Sampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((5, 100.0),)))
    assert {forced.sample(LOGITS) for _ in range(20)} == {5}
    shifted = Sampler(SamplingParams(logit_bias=((2, 1.5),))).adjusted(LOGITS)
    assert torch.equal(shifted, LOGITS + torch.tensor([0, 0, 1.5, 0, 0, 0]))


def test_penalties_follow_openai_formula() -> None:
    # mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c over generated tokens
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25))
    assert torch.equal(s.adjusted(LOGITS), LOGITS)  # nothing generated yet
    assert [s.sample(LOGITS) for _ in range(3)] == [0, 0, 1]  # 4.0, then 3.25 > 3.0, then 2.5 < 3
    counts = torch.tensor([2.0, 1, 0, 0, 0, 0])
    want = LOGITS - 0.5 * counts - 0.25 * (counts > 0)
    assert torch.equal(s.adjusted(LOGITS), want)
    # a negative penalty encourages repeats
    r = Sampler(SamplingParams(temperature=0.0, presence_penalty=-2.0))
    assert [r.sample(torch.tensor([1.0, 1.5])) for _ in range(3)] == [1, 1, 1]
    plain = Sampler(SamplingParams(temperature=0.0))
    assert [plain.sample(LOGITS) for _ in range(3)] == [0, 0, 0]


def test_logprobs_of_the_adjusted_distribution() -> None:
    s = Sampler(SamplingParams(temperature=0.0, logprobs=2, logit_bias=((1, 2.0),)))
    d = s.draw(LOGITS)
    want = (LOGITS + torch.tensor([0, 2.0, 0, 0, 0, 0])).log_softmax(-1)
    assert d.token == 1 and d.logprob == pytest.approx(float(want[1]))
    assert [t for t, _ in d.top] == [1, 0]
    assert [lp for _, lp in d.top] == pytest.approx([float(want[1]), float(want[0])])
    assert Sampler(SamplingParams(logprobs=0)).draw(LOGITS).top == ()
    assert Sampler(SamplingParams()).draw(LOGITS).logprob is None


def test_allowed_mask_restricts_the_draw() -> None:
    allowed = torch.tensor([False, False, False, True, True])  # shorter than the logits
    s = Sampler(SamplingParams(seed=0))
    assert {s.draw(LOGITS, allowed).token for _ in range(50)} == {3, 4}
    assert Sampler(SamplingParams(temperature=0.0)).draw(LOGITS, allowed).token == 3


def _reference(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters by their definitions, one row, sorting the whole vocabulary."""
    scores = (scores.double() - scores.max()) / p.temperature
    if 0 < p.top_k < scores.numel():
        scores = scores.masked_fill(scores < scores.topk(p.top_k).values[-1], float("-inf"))
    probs = scores.softmax(-1)
    if p.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        drop = ordered.cumsum(-1) - ordered >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def test_filtered_rows_follow_the_definitions_each_on_its_own() -> None:
    """`filtered` over rows of mixed settings: each row as the definitions give it alone,
    whether its top-p cut lies among the likeliest `TOP_P_WIDTH` tokens or past them (a flat
    row of a vocabulary wider than that)."""
    from stratad.runtime.sampling import TOP_P_WIDTH, filtered

    g = torch.Generator().manual_seed(3)
    vocab = 3 * TOP_P_WIDTH
    spread = torch.tensor([4.0, 2.0, 0.05, 1.0, 3.0, 0.01])[:, None]
    rows = torch.randn(6, vocab, generator=g) * spread
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=50),
              SamplingParams(temperature=1.3, top_p=0.95),  # flat: the cut is past the width
              SamplingParams(min_p=0.2, top_k=400), SamplingParams(),
              SamplingParams(top_p=0.5, min_p=0.01)]  # fmt: skip
    got = filtered(rows, params)
    for i, p in enumerate(params):
        want = _reference(rows[i], p)
        assert ((got[i] > 0) == (want > 0)).all(), p
        assert torch.allclose(got[i], want, atol=1e-12), p
        assert torch.equal(filtered(rows[i : i + 1], [p])[0], got[i])  # alone, the same
    assert (got[2] > 0).sum() > TOP_P_WIDTH  # that row did reach past the width


def test_draw_rows_inverts_each_rows_distribution() -> None:
    """Greedy rows give their argmax; a tempered row the token where its cumulative filtered
    mass passes the row's uniform number (so evenly spaced numbers hit each token in
    proportion to its probability); a NaN row gives None and leaves the others be."""
    from stratad.runtime.sampling import draw_rows, filtered

    p = SamplingParams(temperature=1.0, top_p=0.95)
    greedy = SamplingParams(temperature=0.0)
    n = 2000
    us = [(i + 0.5) / n for i in range(n)]
    rows = LOGITS[None].expand(n, -1)
    counts = torch.bincount(torch.tensor(draw_rows(rows, [p] * n, us)), minlength=6)
    assert torch.allclose(counts / n, filtered(LOGITS[None], [p])[0].float(), atol=1e-3)
    mixed = torch.stack([LOGITS, torch.full((6,), float("nan")), LOGITS.flip(0)])
    assert draw_rows(mixed, [p, p, greedy], [0.0, 0.5, 0.9]) == [0, None, 5]
    with pytest.raises(ValueError, match="3 rows of logits, 2 params"):
        draw_rows(mixed, [p, p], [0.0, 0.5])


def test_draw_on_device_is_draw_rows_without_the_wait() -> None:
    """The draws left on the device (a step queued from them before the host reads them):
    the tokens `draw_rows` gives, greedy and tempered rows mixed, a NaN row not ok; a row
    whose top-p cut lies past the likeliest `TOP_P_WIDTH` tokens (a flat row) is not sorted
    whole but flagged, for `draw_rows` to draw again."""
    from stratad.runtime.sampling import TOP_P_WIDTH, draw_on_device, draw_rows

    g = torch.Generator().manual_seed(5)
    vocab = 2 * TOP_P_WIDTH
    rows = torch.randn(5, vocab, generator=g) * torch.tensor([4.0, 3.0, 5.0, 1.0, 2.0])[:, None]
    rows[3] = float("nan")
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(top_k=40, min_p=0.05), SamplingParams(),
              SamplingParams(seed=1)]  # fmt: skip
    us = [0.3, 0.0, 0.9, 0.5, 0.7]
    drawn = draw_on_device(rows, params, us)
    want = draw_rows(rows, params, us)
    assert not bool(drawn.redo) and drawn.ok.tolist() == [t is not None for t in want]
    assert [t if ok else None for t, ok in zip(drawn.tokens.tolist(), drawn.ok.tolist(),
                                               strict=True)] == want  # fmt: skip
    greedy, zeros = [SamplingParams(temperature=0.0)] * 5, [0.0] * 5
    assert draw_on_device(rows, greedy, zeros).tokens.tolist() == draw_rows(rows, greedy, zeros)
    flat = torch.randn(2, vocab, generator=g) * 0.01
    cut = [SamplingParams(top_p=0.95), SamplingParams(temperature=0.0)]
    assert bool(draw_on_device(flat, cut, [0.4, 0.0]).redo)
    with pytest.raises(ValueError, match="2 rows of logits, 1 params"):
        draw_on_device(flat, cut[:1], [0.4])
