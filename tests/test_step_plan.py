"""The scheduler's decision of one step (`plan_step`), as plain numbers: which running
sequences compute this step, under the step's token budget."""

from __future__ import annotations

import pytest

from stratad.runtime.step_plan import StepBudget, Want, plan_step

D = Want(1, decoding=True)


def P(n: int) -> Want:  # noqa: N802 (reads as the plan's notation: a prompt chunk of n)
    return Want(n, decoding=False)


def test_every_decode_computes_every_step_whatever_the_budget() -> None:
    assert plan_step([D] * 8, StepBudget(tokens=4, chunk=32)) == list(range(8))


def test_prompt_chunks_fill_what_the_decodes_leave_in_arrival_order() -> None:
    budget = StepBudget(tokens=40, chunk=32)
    # three decodes (3 tokens) and a 32-token chunk fit; the next chunk (8) does not: 43 > 40
    assert plan_step([P(32), D, P(8), D, D], budget) == [0, 1, 3, 4]
    # a short chunk fits beside a long one when the budget has room
    assert plan_step([P(32), D, P(5), D, D], budget) == [0, 1, 2, 3, 4]


def test_a_chunk_that_does_not_fit_is_not_passed_over() -> None:
    """Later short prompts wait behind the oldest one's chunk: no prompt starves."""
    budget = StepBudget(tokens=34, chunk=32)
    assert plan_step([D, D, D, P(32), P(1), P(1)], budget) == [0, 1, 2]


def test_a_step_never_computes_nothing() -> None:
    """A chunk larger than the whole budget still runs when nothing else would."""
    assert plan_step([P(100), P(3)], StepBudget(tokens=10, chunk=100)) == [0]
    assert plan_step([], StepBudget(tokens=10, chunk=100)) == []


def test_the_default_budget_is_a_chunk_beside_every_decode() -> None:
    budget = StepBudget.auto(chunk=128, parallel=8)
    assert budget == StepBudget(tokens=136, chunk=128)
    assert plan_step([D] * 7 + [P(128), P(128)], budget) == list(range(8))
    assert StepBudget.auto(chunk=128, parallel=8, tokens=300).tokens == 300
    with pytest.raises(ValueError, match="positive"):
        StepBudget(tokens=0, chunk=8)


def test_short_prompts_wait_for_room_in_the_pass_rather_than_overflow_it() -> None:
    """With a forward whose decode pass takes 16 rows and prompts of up to 8 tokens as rows,
    short prompts fill the pass beside the decodes and the rest wait for the next step (no
    separate prefill pass for them); a long chunk goes by the token budget as before; a
    prompt the decodes alone leave no room for runs (as a chunk) rather than starve."""
    budget = StepBudget.auto(chunk=64, parallel=8, rows=16, row_tokens=8)
    # 4 decodes + 6 + 6 = 16 rows; the third prompt (6 more) waits, though tokens would allow
    assert plan_step([D, D, D, D, P(6), P(6), P(6)], budget) == [0, 1, 2, 3, 4, 5]
    assert plan_step([P(6), P(6), P(6)], budget) == [0, 1]
    # a long chunk (more than row_tokens) is a prefill chunk: the rows do not bound it
    assert plan_step([D, D, P(40), P(6)], budget) == [0, 1, 2, 3]
    assert plan_step([D] * 14 + [P(40)], budget) == list(range(15))
    # decodes that fill the pass do not hold the prompt back (it goes as a chunk)
    assert plan_step([D] * 16 + [P(6), P(6)], budget) == list(range(17))
    assert plan_step([P(8)], StepBudget(tokens=4, chunk=8, rows=4, row_tokens=8)) == [0]
    # one token of a prompt is a decode-like row of the pass
    assert budget.as_rows(1) is False and budget.as_rows(8) and not budget.as_rows(9)
    assert not StepBudget(tokens=4, chunk=8).as_rows(2)  # a forward without the pass
