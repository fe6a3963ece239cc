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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

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

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], block_size: int) -> None:
        rows = k[0].shape[0]
        if block_size < 8 or block_size & (block_size - 1) or rows % block_size:
            raise ValueError(
                f"{rows} rows are not whole blocks of {block_size} (a power of 2, >= 8)"
            )
        self.k, self.v, self.block_size = k, v, block_size
        self.n_blocks = rows // block_size
        self._free = list(range(self.n_blocks))  # a heap: the lowest free id first
        self.devices = list(dict.fromkeys(t.device for t in k))

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        tokens: int,
        devices: Sequence[torch.device],
        dtype: torch.dtype,
        zeroed: bool = False,
        block_size: int = BLOCK_SIZE,
    ) -> KVPool:
        """A pool of at least `tokens` rows, layer i on devices[i]. `zeroed` False: the
        buffers as allocated (attention never reads past a cache's length)."""
        n = -(-max(tokens, 1) // block_size) * block_size
        shape = (n, spec.n_kv_heads, spec.head_dim)
        new = torch.zeros if zeroed else torch.empty
        k = [new(shape, device=d, dtype=dtype) for d in devices]
        v = [new(shape, device=d, dtype=dtype) for d in devices]
        return cls(k, v, block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        return 2 * sum(t[: self.block_size].nbytes for t in self.k)

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.block_bytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolFull(
                f"the KV pool has {len(self._free)} free blocks of {self.block_size} tokens,"
                f" {n} wanted"
            )
        return [heapq.heappop(self._free) for _ in range(n)]

    def give(self, ids: Sequence[int]) -> None:
        for i in ids:
            heapq.heappush(self._free, i)

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
        """The blocks `tokens` more tokens need beyond those held."""
        return max(self.pool.blocks_for(self.length + tokens) - len(self.blocks), 0)

    def reserve(self, length: int) -> None:
        """Hold blocks for the first `length` positions (taken from the pool; raises
        `KVPoolFull`, nothing taken, if it has too few)."""
        if length > self.capacity:
            raise ValueError(f"{length} tokens exceed the KV cache of {self.capacity}")
        want = self.pool.blocks_for(length) - len(self.blocks)
        if want <= 0:
            return
        new = self.pool.take(want)
        at = len(self.blocks)
        self.blocks.extend(new)
        ids = torch.tensor(new, dtype=torch.int32)
        for table in self.tables.values():
            table[at : at + want].copy_(ids, non_blocking=False)

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens; the blocks past it go back to the pool."""
        self.length = min(self.length, length)
        del self.tokens[self.length :]
        keep = self.pool.blocks_for(self.length)
        if keep < len(self.blocks):
            self.pool.give(self.blocks[keep:])
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


def block_tables(caches: Sequence[KVCache], device: torch.device) -> torch.Tensor:
    """The caches' block tables [B, max_blocks] int32 on `device` (one device-side stack,
    which a captured graph replays)."""
    return torch.stack([c.table(device) for c in caches])
