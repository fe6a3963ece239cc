"""Which running sequences get KV blocks this step, and which give theirs back: the paged
pool's side of the scheduler's decision (`plan_step` is the token budget's side).

Every decoding sequence must get the blocks its next token needs. When the pool (with what
idle caches hold) has too few, the youngest running sequences give their blocks back
(preemption: they recompute their tokens later, as vLLM's recompute mode does), youngest first,
until the older ones' decodes fit; a sequence never preempts an older one. Then prompt chunks
take what is left in arrival order, the first that does not fit ending the list (as the token
budget does). A step with nothing to run gives the oldest prompt's chunk room by preempting
younger sequences.

Pure and torch-free: the unit tests drive it with plain numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stratad.runtime.step_plan import Want


@dataclass(frozen=True)
class BlockPlan:
    run: list[int]  # the sequences that compute this step (arrival order)
    preempt: list[int]  # the sequences whose blocks go back first (youngest first)


def plan_blocks(wants: Sequence[Want], picked: Sequence[int], free: int) -> BlockPlan:
    """`picked`: what the token budget chose (`plan_step`); `free`: the pool's free blocks
    with those idle caches hold."""
    run, preempt = sorted(picked), list[int]()

    def decode_need() -> int:
        return sum(wants[i].blocks for i in run if wants[i].decoding)

    def give_back(keep: int) -> bool:
        """Preempt the youngest sequence younger than `keep` that holds or wants blocks."""
        nonlocal free
        for v in range(len(wants) - 1, keep, -1):
            if v not in preempt and (wants[v].held or v in run):
                preempt.append(v)
                free += wants[v].held
                if v in run:
                    run.remove(v)
                return True
        return False

    decodes = [i for i in run if wants[i].decoding]
    while decodes and decode_need() > free:
        if not give_back(-1):
            break
        decodes = [i for i in run if wants[i].decoding]
    left = free - decode_need()
    kept: list[int] = []
    blocked = False
    for i in run:
        if wants[i].decoding:
            kept.append(i)
        elif not blocked and wants[i].blocks <= left:
            kept.append(i)
            left -= wants[i].blocks
        else:
            blocked = True
    if not kept:
        prompts = [i for i in range(len(wants)) if i not in preempt and not wants[i].decoding]
        if prompts:
            oldest = prompts[0]
            while wants[oldest].blocks > free and give_back(oldest):
                pass
            if wants[oldest].blocks <= free:
                kept = [oldest]
    return BlockPlan(kept, preempt)
