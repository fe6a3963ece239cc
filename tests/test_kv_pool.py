"""The paged KV pool's bookkeeping (stratad/engine/kv.py): blocks handed out lowest first,
references, full blocks shared by their content within a scope, eviction of registered
blocks no cache holds, and copy-on-write of a shared block a cache writes into."""

from __future__ import annotations

import pytest
import torch

from stratad.engine.kv import KVCache, KVPool, KVPoolFull, prompt_keys


def _pool(blocks: int = 4, block_size: int = 8) -> KVPool:
    k = [torch.zeros(blocks * block_size, 1, 2) for _ in range(2)]
    return KVPool(k, [t.clone() for t in k], block_size)


def _write(cache: KVCache, tokens: list[int]) -> None:
    """What a forward does to the cache: its rows hold the tokens (as numbers)."""
    cache.reserve(cache.length + len(tokens))
    rows = cache.rows(cache.length, cache.length + len(tokens), torch.device("cpu"))
    for t in (*cache.k, *cache.v):
        t[rows] = torch.tensor(tokens, dtype=t.dtype)[:, None, None]
    cache.length += len(tokens)
    cache.tokens.extend(tokens)


def _read(cache: KVCache) -> list[int]:
    rows = cache.rows(0, cache.length, torch.device("cpu"))
    return [int(x) for x in cache.k[0][rows, 0, 0]]


def test_blocks_are_taken_lowest_first_and_given_back() -> None:
    pool = _pool()
    a = KVCache(pool, 32)
    _write(a, list(range(10)))
    assert a.blocks == [0, 1] and pool.free_blocks == 2
    a.truncate(8)
    assert a.blocks == [0] and pool.free_blocks == 3
    with pytest.raises(KVPoolFull, match="3 free blocks"):
        KVCache(pool, 64).reserve(40)
    a.release()
    assert pool.free_blocks == 4 and pool.refs == [0] * 4


def test_full_blocks_are_shared_within_their_scope_and_evicted_tail_first() -> None:
    pool = _pool()
    a = KVCache(pool, 32)
    _write(a, list(range(20)))
    a.seal("alice")  # blocks 0 and 1 are full: registered
    keys = prompt_keys(list(range(20)), "alice", 8)
    assert pool.lookup(keys) == [0, 1]
    assert pool.lookup(prompt_keys(list(range(20)), "bob", 8)) == []  # another scope
    assert pool.lookup(prompt_keys([0, 1, 2, 3, 4, 5, 6, 99], "alice", 8)) == []
    b = KVCache(pool, 32)
    b.adopt([0, 1], keys, list(range(16)))
    assert pool.refs[:2] == [2, 2] and _read(b) == list(range(16))
    a.release()
    b.release()
    # free, but still hits until the pool needs them: unused blocks go first
    assert pool.free_blocks == 4 and pool.lookup(keys) == [0, 1]
    c = KVCache(pool, 32)
    c.reserve(16)
    assert c.blocks == [2, 3] and pool.lookup(keys) == [0, 1]
    c.reserve(24)  # then the registered block freed longest ago: a prefix's last goes first
    assert c.blocks == [2, 3, 1] and pool.lookup(keys) == [0]


def test_a_cache_never_writes_into_a_block_another_holds() -> None:
    """Truncated into a block it shares, a cache copies it before writing: the other's
    keys and values stay."""
    pool = _pool()
    a = KVCache(pool, 32)
    _write(a, list(range(16)))
    a.seal("s")
    b = KVCache(pool, 32)
    b.adopt(pool.lookup(prompt_keys(list(range(16)), "s", 8)), prompt_keys(range(16), "s", 8),
            list(range(16)))  # fmt: skip
    b.truncate(12)  # into block 1, which a holds too
    assert b.blocks_to_add(1) == 1  # the copy
    _write(b, [100, 101])
    assert b.blocks[0] == 0 and b.blocks[1] != 1
    assert _read(a) == list(range(16))
    assert _read(b) == list(range(12)) + [100, 101]
    # its own registered block: written in place, its registration dropped
    a.truncate(12)
    _write(a, [7])
    assert a.blocks[1] == 1 and pool.lookup(prompt_keys(list(range(16)), "s", 8)) == [0]
