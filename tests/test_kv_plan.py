"""The KV pool's side of a step's plan (`plan_blocks`), as plain numbers: which running
sequences get blocks, which give theirs back (preemption, youngest first)."""

from __future__ import annotations

from stratad.runtime.kv_plan import BlockPlan, plan_blocks
from stratad.runtime.step_plan import Want


def D(blocks: int = 0, held: int = 1) -> Want:  # noqa: N802 (the plan's notation: a decode)
    return Want(1, decoding=True, blocks=blocks, held=held)


def P(blocks: int, held: int = 0) -> Want:  # noqa: N802 (a prompt chunk)
    return Want(32, decoding=False, blocks=blocks, held=held)


def test_everything_runs_while_the_pool_has_room() -> None:
    wants = [D(1), D(0), P(2)]
    assert plan_blocks(wants, [0, 1, 2], free=3) == BlockPlan([0, 1, 2], [])


def test_a_prompt_waits_for_blocks_and_later_prompts_wait_behind_it() -> None:
    wants = [D(1), P(3), P(1)]
    # the decode takes 1 of 3: the first prompt needs 3 and waits, the second waits behind it
    assert plan_blocks(wants, [0, 1, 2], free=3) == BlockPlan([0], [])


def test_decodes_preempt_the_youngest_first() -> None:
    """No free block, two decodes need one each: the youngest sequences give theirs back
    until the older decodes fit (a prompt holding blocks is younger than both here)."""
    wants = [D(1, held=4), D(1, held=4), P(2, held=3)]
    plan = plan_blocks(wants, [0, 1, 2], free=0)
    assert plan == BlockPlan([0, 1], [2])  # the prompt's 3 blocks cover both decodes
    wants = [D(1, held=4), D(1, held=1), D(1, held=1)]
    # the youngest decode gives 1 back: still one short, so the next youngest goes too
    assert plan_blocks(wants, [0, 1, 2], free=0) == BlockPlan([0], [2, 1])


def test_a_sequence_never_preempts_an_older_one() -> None:
    """The oldest decode always keeps its place; a youngest that needs a block preempts
    itself if nobody younger holds any."""
    wants = [D(0, held=8), D(1, held=2)]
    assert plan_blocks(wants, [0, 1], free=0) == BlockPlan([0], [1])


def test_an_idle_step_makes_room_for_the_oldest_prompt() -> None:
    """Nothing decodes and the oldest prompt's chunk does not fit: younger sequences holding
    blocks give them back so that it runs; if even the whole pool is too small, nothing runs
    (the loop then fails that request alone)."""
    wants = [P(4), P(1, held=3)]
    assert plan_blocks(wants, [0, 1], free=1) == BlockPlan([0], [1])
    assert plan_blocks([P(9)], [0], free=4) == BlockPlan([], [])


def test_what_the_token_budget_left_out_can_still_be_preempted() -> None:
    """A prompt the token budget did not pick this step still holds blocks: it is the
    youngest, so it gives them back first."""
    wants = [D(1, held=2), P(1, held=2)]
    assert plan_blocks(wants, [0], free=0) == BlockPlan([0], [1])
