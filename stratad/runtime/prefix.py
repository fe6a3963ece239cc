"""Prefix reuse across requests: KV snapshots of recent conversations and of pinned prefixes.

The generator's working KV caches hold blocks of one pool. Before a request overwrites a
conversation that is still in one, that conversation's KV is copied out into a snapshot
here; a later request whose prompt starts with a snapshot's tokens copies it back instead of
recomputing it (copying is a memcpy, recomputing is a forward pass). Pinned snapshots (the
`strata_prefix` extension: a long shared document asked many questions) have their own
budget and are evicted only by other pins. Both budgets are bytes, evicted least recently used
first.

A recurrent model's snapshot also holds its recurrent state (`stratad.engine.recurrent`),
which stands for exactly the snapshot's tokens: such a snapshot is reused whole or not at all,
and a longer one does not cover a shorter one.

Every snapshot belongs to a scope (a hash of the API key and `user` that made it): a request
reuses only its own scope's prefixes, so the tokens it finds cached never tell one client what
another sent.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stratad.engine.kv import KVCache
from stratad.engine.recurrent import HeldState

# Conversations shorter than this are cheaper to recompute than to keep.
MIN_SNAPSHOT_TOKENS = 16


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    k: torch.Tensor  # [L, n, Hkv, D] (the L layers that keep KV)
    v: torch.Tensor  # k itself where the pool's values are its keys (`KVPool.values_are_keys`)
    pinned: bool
    used: int  # logical clock of the last use (LRU)
    scope: str = ""  # whose prefix it is: only requests of the same scope reuse it
    state: HeldState | None = None  # a recurrent model's state after all of `tokens`

    @property
    def nbytes(self) -> int:
        held = self.state.nbytes if self.state is not None else 0
        return self.k.nbytes + (0 if self.v is self.k else self.v.nbytes) + held

    def reusable(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` it holds: their common prefix; for a recurrent state, all of
        its tokens where they start `tokens` and leave one to compute, else none."""
        n = common_prefix(self.tokens, tokens)
        if self.state is None:
            return n
        return n if n == len(self.tokens) < len(tokens) else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    a, b = tuple(a), tuple(b)  # slices of one type compare in C
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slices (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixStore:
    """Snapshots of KV prefixes, on the host, under two byte budgets."""

    def __init__(self, conversation_bytes: int, pinned_bytes: int) -> None:
        self.budget = {False: conversation_bytes, True: pinned_bytes}
        self.snapshots: list[Snapshot] = []
        self._clock = itertools.count()

    def bytes_used(self, pinned: bool | None = None) -> int:
        return sum(s.nbytes for s in self.snapshots if pinned is None or s.pinned == pinned)

    def best(self, tokens: Sequence[int], scope: str = "") -> tuple[Snapshot | None, int]:
        """The snapshot of `scope` holding the longest prefix of `tokens`, and that length
        (`Snapshot.reusable`)."""
        tokens = tuple(tokens)
        best, length = None, 0
        for s in self.snapshots:
            if s.scope != scope:
                continue
            n = s.reusable(tokens)
            if n > length:
                best, length = s, n
        return best, length

    def has(self, tokens: tuple[int, ...], pinned: bool, scope: str = "") -> bool:
        return any(
            s.tokens == tokens and s.pinned == pinned and s.scope == scope for s in self.snapshots
        )

    def save(self, cache: KVCache, length: int, pinned: bool = False, scope: str = "") -> bool:
        """Copy the first `length` tokens of `cache` into a snapshot of `scope`; False if not
        kept. A recurrent model's cache is kept at its state's length alone (the state is
        copied with it)."""
        tokens = tuple(cache.tokens[:length])
        if (length < MIN_SNAPSHOT_TOKENS and not pinned) or length > cache.length:
            return False
        if cache.pool.quantized or cache.pool.host:  # snapshots hold plain rows of one tier
            return False
        net, exact = cache.recurrent, cache.pool.recurrent
        if exact and (net is None or net.length != length):
            return False  # no state stands for these tokens
        # a snapshot of the same kind that already holds these tokens (or more: not a state's)
        for s in self.snapshots:
            same = s.pinned == pinned and s.scope == scope and s.tokens[:length] == tokens
            if same and (not exact or len(s.tokens) == length):
                s.used = next(self._clock)
                return True
        shared = cache.pool.values_are_keys  # (values of their own width counted as such)
        per_token = sum(t[0].nbytes for t in (*cache.k, *([] if shared else cache.v))
                        if t.shape[0])  # fmt: skip
        if length * per_token + (net.nbytes if net is not None else 0) > self.budget[pinned]:
            return False
        held = HeldState.of(net) if net is not None else None
        rows = {d: cache.rows(0, length, d) for d in {k.device for k in cache.k}}
        if not exact:  # the new one covers shorter conversations it extends (a state's not)
            self.snapshots = [
                s
                for s in self.snapshots
                if s.pinned or pinned or s.scope != scope or tokens[: len(s.tokens)] != s.tokens
            ]
        k = _to_host([k[rows[k.device]] for k in cache.k if k.shape[0]])
        snap = Snapshot(
            tokens=tokens,
            k=k,
            v=k if shared else _to_host([v[rows[v.device]] for v in cache.v if v.shape[0]]),
            pinned=pinned,
            used=next(self._clock),
            scope=scope,
            state=held,
        )
        self.snapshots.append(snap)
        self._evict(pinned)
        return True

    def restore(self, snap: Snapshot, length: int, cache: KVCache) -> None:
        """Make `cache` hold the snapshot's first `length` tokens (the blocks it needs taken
        from its pool); a recurrent state's snapshot all of them, its state restored."""
        if snap.state is not None and length != len(snap.tokens):
            raise ValueError(f"a recurrent state stands for all {len(snap.tokens)} tokens of"
                             f" its snapshot, not {length}")  # fmt: skip
        cache.truncate(0)
        cache.reserve(length)
        rows = {d: cache.rows(0, length, d) for d in {k.device for k in cache.k}}
        with_kv = [(k, v) for k, v in zip(cache.k, cache.v, strict=True) if k.shape[0]]
        for i, (k, v) in enumerate(with_kv):
            k.index_copy_(0, rows[k.device], snap.k[i, :length].to(k.device))
            if v is not k:
                v.index_copy_(0, rows[v.device], snap.v[i, :length].to(v.device))
        cache.length = length
        cache.tokens[:] = snap.tokens[:length]
        if snap.state is not None:
            cache.recurrent = snap.state.restored()
        snap.used = next(self._clock)

    def _evict(self, pinned: bool) -> None:
        kind = sorted((s for s in self.snapshots if s.pinned == pinned), key=lambda s: s.used)
        used = sum(s.nbytes for s in kind)
        for s in kind:
            if used <= self.budget[pinned]:
                break
            self.snapshots.remove(s)
            used -= s.nbytes


def _to_host(layers: list[torch.Tensor]) -> torch.Tensor:
    """Each layer's rows [T, ...] stacked on the host [layers, T, ...]: one copy (stacked on
    the device first), not one per layer. From a GPU the copy goes into page-locked memory
    without waiting: the engine thread queues the next step meanwhile, and `restore`'s copy
    back is queued after it on the same stream."""
    devices = {x.device for x in layers}
    if len(devices) > 1:  # a layer split: layers on several devices
        return torch.stack([x.cpu() for x in layers])
    stacked = torch.stack(layers)
    if stacked.device.type != "cuda":
        return stacked.cpu()
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    return host.copy_(stacked, non_blocking=True)
