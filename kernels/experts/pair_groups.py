"""The (token, expert) pairs of a MoE step grouped by expert, inside a kernel.

A step of T tokens routed top-k has T * k pairs, program s of a launch owning pair s. Where
several tokens share an expert, the first pair routed to it can compute them all (reading the
expert's rows once) while the programs of the others return at once. The routing stays on the
device: each program finds its group by scanning the ids, which keeps a step free of host
synchronisation and capturable in a graph.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def group_of(ids_ptr, s, e, N_PAIRS, PAIRS: tl.constexpr):
    """Pairs routed to expert `e`, for program `s`: (whether s is the first of them, the
    pairs [PAIRS] as a mask over 0..PAIRS-1)."""
    at = tl.arange(0, PAIRS)
    every = tl.load(ids_ptr + at, mask=at < N_PAIRS, other=-1)
    members = (every == e) & (at < N_PAIRS)
    first = tl.min(tl.where(members, at, PAIRS)) == s
    return first, members


@triton.jit
def next_member(members, j, PAIRS: tl.constexpr):
    """The next pair after j of an expert's group (PAIRS: none)."""
    at = tl.arange(0, PAIRS)
    return tl.min(tl.where(members & (at > j), at, PAIRS))


@triton.jit
def members_chunk(members, c0, PAIRS: tl.constexpr, M: tl.constexpr):
    """Members c0 .. c0 + M - 1 of a group (in pair order): their pair indices [M] and which
    of them exist."""
    at = tl.arange(0, PAIRS)
    pos = tl.cumsum(members.to(tl.int32), 0) - 1  # each member's place in the group
    slot = c0 + tl.arange(0, M)
    hit = members[:, None] & (pos[:, None] == slot[None, :])  # [PAIRS, M]
    pair = tl.sum(tl.where(hit, at[:, None], 0), axis=0)
    return pair, slot < tl.sum(members.to(tl.int32))
