"""Paged KV: one pool of KV blocks per engine, shared by every sequence, and each sequence's
cache as a list of the pool's blocks (as vLLM's and nano-vllm's block managers do).

A pool holds, per layer, keys and values [n_blocks * block_size, n_kv_heads, D] on that
layer's device (a layer split puts layers on several devices; a block id names the same rows
in every layer). A sequence's `KVCache` takes blocks as it grows and gives them back when it
is truncated or released, so running sequences share the pool's memory by what they hold,
not by their context limit. Position p of a cache lives at pool row
`blocks[p // block_size] * block_size + p % block_size` (`kernels.layers.paged`): the
attention kernels read and write through each cache's block table, which lives on every
device of the pool (`KVCache.table`, one [max_blocks] int32 tensor per device, kept at one
address so a captured CUDA graph replays with the blocks a cache has then).

Full blocks are shared by their content (vLLM's automatic prefix caching): a block whose 32
tokens are all written is registered under a hash of its tokens, the hash of the blocks
before it and the scope of the request that wrote it (a hash of its API key: a request
reuses only its own scope's prefixes). A request whose prompt starts with registered blocks
takes references to them instead of computing them; a block no cache references any more
stays registered, evicted least recently freed first when the pool needs blocks. A cache
never writes into a block another references (nor into a registered one): it copies the
block first (copy-on-write), which happens only where a truncated cache writes into its
last, partly shared block.
"""

from __future__ import annotations

import array
import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from stratad.host_copy import to_device
from stratad.model.spec import ModelSpec

BLOCK_SIZE = 32  # tokens per block: a multiple of 8 (the CPU kernels' key groups)


def pool_tokens(caches: int, capacity: int, block_size: int = BLOCK_SIZE) -> int:
    """The rows a pool needs for `caches` caches of `capacity` tokens each, all full."""
    return caches * -(-capacity // block_size) * block_size


class KVPoolFull(RuntimeError):
    """The pool has no free block for a sequence that grows."""


class KVPool:
    """One engine's KV blocks; `take` and `give` hand them out, lowest ids first (on the host
    the pages of a pool allocated empty commit only as blocks are first written, so the low
    ids a light load keeps reusing are all the memory it costs)."""

    def __init__(
        self,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        block_size: int,
        scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        """`scales`: int8 k/v's float32 (k, v) scales per layer [rows, Hkv]
        (`kernels.formats.kv_int8`); None: k/v hold the values as they are."""
        rows = k[0].shape[0]
        if block_size < 8 or block_size & (block_size - 1) or rows % block_size:
            raise ValueError(
                f"{rows} rows are not whole blocks of {block_size} (a power of 2, >= 8)"
            )
        self.k, self.v, self.block_size = k, v, block_size
        self.k_scale, self.v_scale = scales if scales is not None else ([], [])
        self.quantized = scales is not None
        if self.quantized and any(t.dtype != torch.int8 for t in (*k, *v)):
            raise ValueError("a pool with scales holds int8 keys and values")
        self.n_blocks = rows // block_size
        self._free = list(range(self.n_blocks))  # a heap: the lowest free id first
        self.devices = list(dict.fromkeys(t.device for t in k))
        self.refs = [0] * self.n_blocks  # caches holding each block
        self._by_hash: dict[Hashable, int] = {}  # registered full blocks
        self._hash_of: dict[int, Hashable] = {}
        # registered blocks no cache holds, least recently freed first: free, but still hits
        self._cached: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        tokens: int,
        devices: Sequence[torch.device],
        dtype: torch.dtype,
        zeroed: bool = False,
        block_size: int = BLOCK_SIZE,
        int8: bool = False,
    ) -> KVPool:
        """A pool of at least `tokens` rows, layer i on devices[i], in `dtype` (`int8`: int8
        with a float32 scale per token and KV head). `zeroed` False: the buffers as
        allocated (attention never reads past a cache's length)."""
        n = -(-max(tokens, 1) // block_size) * block_size
        shape = (n, spec.n_kv_heads, spec.head_dim)
        new = torch.zeros if zeroed else torch.empty
        store = torch.int8 if int8 else dtype
        k = [new(shape, device=d, dtype=store) for d in devices]
        v = [new(shape, device=d, dtype=store) for d in devices]
        if not int8:
            return cls(k, v, block_size)
        scales = tuple([torch.zeros(shape[:2], device=d, dtype=torch.float32) for d in devices]
                       for _ in range(2))  # fmt: skip
        return cls(k, v, block_size, (scales[0], scales[1]))

    @property
    def free_blocks(self) -> int:
        """Blocks `take` can hand out: never used, and registered ones no cache holds."""
        return len(self._free) + len(self._cached)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values (and their scales)."""
        scales = sum(t[: self.block_size].nbytes for t in (*self.k_scale, *self.v_scale))
        return 2 * sum(t[: self.block_size].nbytes for t in self.k) + scales

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.block_bytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def take(self, n: int) -> list[int]:
        """`n` blocks for a cache (one reference each): unused ones first, then registered
        ones no cache holds, least recently freed first (their registration dropped)."""
        if n > self.free_blocks:
            raise KVPoolFull(
                f"the KV pool has {self.free_blocks} free blocks of {self.block_size} tokens,"
                f" {n} wanted"
            )
        out = []
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b, _ = self._cached.popitem(last=False)
                self.unregister(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def give(self, ids: Sequence[int]) -> None:
        """A cache lets go of its references to `ids`."""
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                if i in self._hash_of:
                    self._cached[i] = None  # still a hit until the pool needs it
                else:
                    heapq.heappush(self._free, i)

    def share(self, ids: Sequence[int]) -> None:
        """One more reference to each of `ids` (registered blocks a new cache starts with)."""
        for i in ids:
            if self.refs[i] == 0:
                del self._cached[i]
            self.refs[i] += 1

    def register(self, block: int, key: Hashable) -> None:
        """`block` is full and holds what `key` names (a block already registered under
        `key` keeps it: the two hold the same keys and values)."""
        if key not in self._by_hash and block not in self._hash_of:
            self._by_hash[key] = block
            self._hash_of[block] = key

    def unregister(self, block: int) -> None:
        key = self._hash_of.pop(block, None)
        if key is not None:
            del self._by_hash[key]

    def registered(self, block: int) -> bool:
        return block in self._hash_of

    def lookup(self, keys: Sequence[Hashable]) -> list[int]:
        """The registered blocks of the longest prefix of `keys`."""
        out = []
        for key in keys:
            b = self._by_hash.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def copy_block(self, src: int, dst: int) -> None:
        """Block `src`'s keys and values into block `dst` (every layer)."""
        bs = self.block_size
        for t in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            t[dst * bs : dst * bs + bs].copy_(t[src * bs : src * bs + bs])

    def same_kind(self, other: KVPool) -> bool:
        return self is other


@dataclass(eq=False)
class KVCache:
    """One sequence's KV: the pool's blocks it holds, in position order, up to `capacity`
    tokens (its context limit)."""

    pool: KVPool
    capacity: int
    length: int = 0  # tokens whose keys and values are stored
    tokens: list[int] = field(default_factory=list)  # the ids behind them (for prefix reuse)
    blocks: list[int] = field(default_factory=list)
    # per device: the block ids, [max_blocks] int32 padded with 0 (written in place)
    tables: dict[torch.device, torch.Tensor] = field(init=False, repr=False)
    keys: list[Hashable] = field(default_factory=list)  # the registered keys of its first blocks

    def __post_init__(self) -> None:
        n = self.pool.blocks_for(self.capacity)
        self.tables = {d: torch.zeros(n, dtype=torch.int32, device=d) for d in self.pool.devices}

    @property
    def k(self) -> list[torch.Tensor]:
        """The pool's keys per layer (every cache of the pool shares them)."""
        return self.pool.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.pool.v

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def max_blocks(self) -> int:
        return self.pool.blocks_for(self.capacity)

    def same_kind(self, other: KVCache) -> bool:
        """Whether the two caches are of one pool and one table length (a kernel reads a batch
        of them through one pool and one [B, max_blocks] table)."""
        return self.pool is other.pool and self.max_blocks == other.max_blocks

    def blocks_to_add(self, tokens: int) -> int:
        """The blocks `tokens` more tokens need beyond those held (and the copy of a shared
        block they would write into)."""
        new = max(self.pool.blocks_for(self.length + tokens) - len(self.blocks), 0)
        i = self.length // self.block_size
        shared = self.length % self.block_size and i < len(self.blocks)
        return new + int(bool(shared) and self.pool.refs[self.blocks[i]] > 1)

    def own_blocks(self) -> int:
        """The blocks no other cache holds (what releasing this one gives back)."""
        return sum(1 for b in self.blocks if self.pool.refs[b] == 1)

    def reserve(self, length: int) -> None:
        """Hold blocks for the first `length` positions (taken from the pool; raises
        `KVPoolFull`, nothing taken, if it has too few), the block the next token is
        written into its own (copied first where it is shared or registered)."""
        if length > self.capacity:
            raise ValueError(f"{length} tokens exceed the KV cache of {self.capacity}")
        if length > self.length:
            self._own_last()
        want = self.pool.blocks_for(length) - len(self.blocks)
        if want <= 0:
            return
        new = self.pool.take(want)
        at = len(self.blocks)
        self.blocks.extend(new)
        self._write_table(at, new)

    def _write_table(self, at: int, ids: list[int]) -> None:
        for table in self.tables.values():
            table[at : at + len(ids)].copy_(to_device(ids, torch.int32, table.device))

    def _own_last(self) -> None:
        """Copy-on-write: the partly written block the next token goes into, if another
        cache holds it or it is registered (its content must not change under its key)."""
        i, pool = self.length // self.block_size, self.pool
        if i >= len(self.blocks) or self.length % self.block_size == 0:
            return
        b = self.blocks[i]
        if pool.refs[b] == 1:
            pool.unregister(b)  # ours alone: forget what it held
        elif pool.refs[b] > 1:
            (mine,) = pool.take(1)
            pool.copy_block(b, mine)
            pool.give([b])
            self.blocks[i] = mine
            self._write_table(i, [mine])
        del self.keys[i:]

    def adopt(self, blocks: list[int], keys: list[Hashable], tokens: list[int]) -> None:
        """Start an empty cache with registered blocks (their keys, the tokens they hold)."""
        assert not self.blocks and len(tokens) == len(blocks) * self.block_size
        self.pool.share(blocks)
        self.blocks, self.keys = list(blocks), list(keys)
        self._write_table(0, self.blocks)
        self.length, self.tokens = len(tokens), list(tokens)

    def seal(self, scope: str) -> None:
        """Register the full blocks not yet registered, under `scope` (after a step)."""
        bs = self.block_size
        for i in range(len(self.keys), self.length // bs):
            key = block_key(self.keys[-1] if self.keys else None, scope,
                            self.tokens[i * bs : (i + 1) * bs])  # fmt: skip
            self.pool.register(self.blocks[i], key)
            self.keys.append(key)

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens; the blocks past it go back to the pool."""
        self.length = min(self.length, length)
        del self.tokens[self.length :]
        del self.keys[self.length // self.block_size :]
        keep = self.pool.blocks_for(self.length)
        if keep < len(self.blocks):
            # the last first: a prefix's later blocks are evicted before its first ones
            self.pool.give(self.blocks[keep:][::-1])
            del self.blocks[keep:]

    def release(self) -> None:
        """Give every block back (the cache is empty)."""
        self.truncate(0)

    def common_prefix(self, tokens: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n

    def table(self, device: torch.device) -> torch.Tensor:
        """The block table [max_blocks] int32 on `device` ("cuda" is the current GPU)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return self.tables[device]

    def host_table(self) -> np.ndarray:
        """The blocks held, int32 (the CPU kernels' table)."""
        return np.asarray(self.blocks, dtype=np.int32)

    def rows(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """The pool rows [end - start] int64 of positions start..end-1 (held blocks only),
        computed on `device` from its block table (no copy from the host, which would wait
        for the device's queue on every layer)."""
        pos = torch.arange(start, end, device=device)
        bs = self.pool.block_size
        return self.table(device).long()[pos // bs] * bs + pos % bs


def block_key(before: Hashable | None, scope: str, tokens: Sequence[int]) -> Hashable:
    """What a full block holds: its tokens after those the key `before` names, in `scope`
    (a 128-bit BLAKE2 digest of the three: one block's cost, whatever came before it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(before if isinstance(before, bytes) else b"")
    h.update(scope.encode())
    h.update(b"\0")
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


def prompt_keys(tokens: Sequence[int], scope: str, block_size: int) -> list[Hashable]:
    """The keys of the full blocks of `tokens`, in order."""
    keys: list[Hashable] = []
    for i in range(len(tokens) // block_size):
        keys.append(block_key(keys[-1] if keys else None, scope,
                              tokens[i * block_size : (i + 1) * block_size]))  # fmt: skip
    return keys


def block_tables(caches: Sequence[KVCache], device: torch.device) -> torch.Tensor:
    """The caches' block tables [B, max_blocks] int32 on `device` (one device-side stack,
    which a captured graph replays)."""
    return torch.stack([c.table(device) for c in caches])
