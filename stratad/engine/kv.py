"""Paged KV: one pool of KV blocks per engine, shared by every sequence, and each sequence's
cache as a list of the pool's blocks (as vLLM's and nano-vllm's block managers do).

A pool holds, per layer, keys and values [n_blocks * block_size, n_kv_heads, D] on that
layer's device (a layer split puts layers on several devices; a block id names the same rows
in every layer; a linear-attention layer, which keeps a recurrent state instead, holds
none). A sequence's `KVCache` takes blocks as it grows and gives them back when it is
truncated or released, so running sequences share the pool's memory by what they hold, not
by their context limit. Position p of a cache lives at pool row
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

A resident window (`window` tokens, the offload engine's `engine.kv_resident`): a pool may
have a second tier of blocks in page-locked host RAM that the GPU reads in place
(`kernels.layers.paged.HostPages`, ids from `n_blocks` on). As a cache grows, its blocks that
lie wholly before its newest `window` tokens move there (`KVCache.reserve`), so a sequence
holds about `window` tokens of VRAM however long its context: decode attention reads the rest
over PCIe. Only blocks no other cache holds move (a shared prefix stays where it is); a block
keeps its registration as it moves, and registered host blocks stay hits as on the GPU. With
the host tier full, blocks stay in VRAM.
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

from kernels.layers.paged import HostPages, gather_rows
from stratad.engine.kv_format import INT8, PLAIN, KVFormat
from stratad.engine.mapped import mapped_empty
from stratad.engine.recurrent import RecurrentState
from stratad.host_copy import to_device
from stratad.model.spec import ModelSpec

BLOCK_SIZE = 32  # tokens per block: a multiple of 8 (the CPU kernels' key groups)


def pool_tokens(caches: int, capacity: int, block_size: int = BLOCK_SIZE) -> int:
    """The rows a pool needs for `caches` caches of `capacity` tokens each, all full."""
    return caches * -(-capacity // block_size) * block_size


def resident_split(
    tokens: int, capacity: int, window: int, chunk: int, block_size: int = BLOCK_SIZE
) -> tuple[int, int]:
    """A pool of `tokens` rows for caches of `capacity` tokens, each keeping its newest
    `window` in the first tier: (first tier rows, host tier rows). The first tier holds each
    full cache's window and two blocks (the one being filled, the one before it leaves),
    and one prefill chunk of `chunk` tokens besides (a chunk's blocks are taken before any
    of them is written); the host tier the rest of each. No window (0, or one of the whole
    capacity): every row in the first tier."""
    if not window or window >= capacity:
        return tokens, 0
    caches = max(tokens // capacity, 1)
    first = caches * (window + 2 * block_size) + chunk
    return min(first, tokens), caches * (capacity - window)


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
        host: list[HostPages] | None = None,
        window: int = 0,
        fmt: KVFormat | None = None,
    ) -> None:
        """`scales`: int8 k/v's float32 (k, v) scales per layer [rows, Hkv]
        (`kernels.formats.kv_int8`), or 4-bit codes' (scale, minimum) pairs (`fmt` Q4:
        `kernels.formats.kv_q4`); None: k/v hold the values as they are. `host`: each
        layer's second tier (its `first_block` this pool's block count), where a cache's
        blocks before its newest `window` tokens go (see the module)."""
        rows = max(t.shape[0] for t in k)  # a layer without KV (linear attention) has none
        if block_size < 8 or block_size & (block_size - 1) or rows % block_size:
            raise ValueError(
                f"{rows} rows are not whole blocks of {block_size} (a power of 2, >= 8)"
            )
        if any(t.shape[0] not in (0, rows) for t in (*k, *v)):
            raise ValueError(f"every layer's keys and values hold {rows} rows, or none")
        self.k, self.v, self.block_size = k, v, block_size
        # layers without KV keep a recurrent state per sequence (`KVCache.recurrent`)
        self.recurrent = any(not t.shape[0] for t in k)
        self.k_scale, self.v_scale = scales if scales is not None else ([], [])
        self.quantized = scales is not None
        self.fmt = fmt or (INT8 if self.quantized else PLAIN)
        if self.quantized != (self.fmt != PLAIN) or any(
            t.dtype != self.fmt.layout(32, t.dtype).codes for t in (*k, *v)  # (any head dim)
        ):
            raise ValueError(f"keys and values of {k[0].dtype} (scales: {self.quantized}) are"
                             f" not the {self.fmt.name} format's")  # fmt: skip
        self.n_blocks = rows // block_size  # the first tier's (in VRAM on a GPU)
        self.host = host or []
        host_rows = max((tier.k.shape[0] for tier in self.host), default=0)
        self.n_host_blocks = host_rows // block_size
        for i, tier in enumerate(self.host):
            tier.check(k[i], self.k_scale[i] if self.quantized else None)
            held = host_rows if k[i].shape[0] else 0  # none for a layer without KV
            if tier.first_block != self.n_blocks or tier.k.shape[0] != held:
                raise ValueError("every layer's host tier starts at the pool's block count"
                                 " and holds as many blocks (a layer without KV none)")  # fmt: skip
        if self.host and len(self.host) != len(k):
            raise ValueError(f"{len(self.host)} host tiers for {len(k)} layers")
        if self.host and window < 2 * block_size:
            raise ValueError(f"a resident window of {window} tokens is less than two blocks"
                             f" of {block_size}")  # fmt: skip
        self.window = window if self.host else 0
        self._free = list(range(self.n_blocks))  # a heap: the lowest free id first
        self._free_host = list(range(self.n_blocks, self.n_blocks + self.n_host_blocks))
        self.devices = list(dict.fromkeys(t.device for t in k))
        self.refs = [0] * (self.n_blocks + self.n_host_blocks)  # caches holding each block
        self._by_hash: dict[Hashable, int] = {}  # registered full blocks
        self._hash_of: dict[int, Hashable] = {}
        # registered blocks no cache holds, least recently freed first: free, but still hits
        # (one list a tier: `take` hands out the first tier's, `take_host` the host's)
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._cached_host: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        tokens: int,
        devices: Sequence[torch.device],
        dtype: torch.dtype,
        zeroed: bool = False,
        block_size: int = BLOCK_SIZE,
        fmt: KVFormat = PLAIN,
        window: int = 0,
        host_tokens: int = 0,
        values_are_keys: bool = False,
    ) -> KVPool:
        """A pool of at least `tokens` rows, layer i on devices[i], in `dtype` or as `fmt`
        stores it (int8 with a float32 scale per token and KV head, or 4-bit codes with a
        scale and minimum per 32 values: `stratad.engine.kv_format`). `zeroed` False: the buffers as
        allocated (attention never reads past a cache's length). `host_tokens` > 0: a second
        tier of at least that many rows in page-locked host RAM mapped for each layer's
        device, where blocks before each cache's newest `window` tokens go. `values_are_keys`:
        each layer's values are its keys' tensors (latent attention's cache reads one row
        as both: `stratad.engine.offload.config.pool_spec`), held once."""
        n = -(-max(tokens, 1) // block_size) * block_size
        lay, hkv = fmt.layout(spec.head_dim, dtype), spec.n_kv_heads
        vlay = fmt.layout(spec.value_dim, dtype)  # a value head's (MLA's are narrower)
        if values_are_keys and vlay != lay:
            raise ValueError(f"values of {spec.value_dim} dims cannot be keys of {spec.head_dim}")
        new = torch.zeros if zeroed else torch.empty
        # a linear-attention layer keeps no KV: its rows are none (Qwen3-Next's 3 of 4)
        rows = [0 if spec.linear_layer(i) else n for i in range(len(devices))]
        k = [new((r, hkv, *lay.code_shape), device=d, dtype=lay.codes)
             for r, d in zip(rows, devices, strict=True)]  # fmt: skip
        v = list(k) if values_are_keys else [
            new((r, hkv, *vlay.code_shape), device=d, dtype=vlay.codes)
            for r, d in zip(rows, devices, strict=True)]  # fmt: skip
        scales = None
        if lay.scales is not None and vlay.scales is not None:
            ks = [torch.zeros((r, hkv, *lay.scale_shape), device=d, dtype=lay.scales)
                  for r, d in zip(rows, devices, strict=True)]  # fmt: skip
            scales = (ks, list(ks) if values_are_keys else [
                torch.zeros((r, hkv, *vlay.scale_shape), device=d, dtype=vlay.scales)
                for r, d in zip(rows, devices, strict=True)])  # fmt: skip
        host = None
        if host_tokens > 0:
            h = -(-host_tokens // block_size) * block_size

            def tier(d: torch.device, r: int) -> HostPages:
                codes = [mapped_empty((r, hkv, *x.code_shape), x.codes, d)
                         for x in ((lay,) if values_are_keys else (lay, vlay))]  # fmt: skip
                sc: list[torch.Tensor | None] = [None]
                if lay.scales is not None and vlay.scales is not None:
                    sc = [mapped_empty((r, hkv, *x.scale_shape), x.scales, d)  # type: ignore[arg-type]
                          for x in ((lay,) if values_are_keys else (lay, vlay))]  # fmt: skip
                return HostPages(codes[0], codes[-1], sc[0], sc[-1], n // block_size)

            # (a layer without KV: no host rows either)
            host = [tier(d, h if r else 0) for d, r in zip(devices, rows, strict=True)]
        return cls(k, v, block_size, scales, host, window, fmt)

    @property
    def free_blocks(self) -> int:
        """Blocks `take` can hand out: never used, and registered ones no cache holds."""
        return len(self._free) + len(self._cached)

    @property
    def free_host_blocks(self) -> int:
        return len(self._free_host) + len(self._cached_host)

    @property
    def values_are_keys(self) -> bool:
        """Whether each layer's values are its keys' tensors (held once)."""
        return all(v is k for k, v in zip(self.k, self.v, strict=True))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values (and their scales), each
        tensor once."""
        held = {id(t): t for t in (*self.k, *self.v, *self.k_scale, *self.v_scale)}
        return sum(t[: self.block_size].nbytes for t in held.values())

    @property
    def nbytes(self) -> int:
        """The first tier's bytes (VRAM on a GPU)."""
        return self.n_blocks * self.block_bytes

    @property
    def host_nbytes(self) -> int:
        """The host tier's bytes (page-locked RAM)."""
        return self.n_host_blocks * self.block_bytes

    def on_host(self, block: int) -> bool:
        return block >= self.n_blocks

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
        return [self._take(self._free, self._cached) for _ in range(n)]

    def _take(self, free: list[int], cached: OrderedDict[int, None]) -> int:
        if free:
            b = heapq.heappop(free)
        else:
            b, _ = cached.popitem(last=False)
            self.unregister(b)
        self.refs[b] = 1
        return b

    def give(self, ids: Sequence[int]) -> None:
        """A cache lets go of its references to `ids`."""
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                host = self.on_host(i)
                if i in self._hash_of:  # still a hit until the pool needs it
                    (self._cached_host if host else self._cached)[i] = None
                else:
                    heapq.heappush(self._free_host if host else self._free, i)

    def share(self, ids: Sequence[int]) -> None:
        """One more reference to each of `ids` (registered blocks a new cache starts with)."""
        for i in ids:
            if self.refs[i] == 0:
                del (self._cached_host if self.on_host(i) else self._cached)[i]
            self.refs[i] += 1

    def to_host(self, block: int) -> int | None:
        """Move `block` (held by one cache alone, in the first tier) to the host tier: its
        keys and values copied, its registration carried; the host block's id, or None
        where the host tier has no free block. The copy is queued on the current stream,
        after the steps that wrote the block and before those that read the host block."""
        if not self.free_host_blocks:
            return None
        assert self.refs[block] == 1 and not self.on_host(block)
        dst = self._take(self._free_host, self._cached_host)
        self.copy_block(block, dst)
        key = self._hash_of.pop(block, None)
        if key is not None:
            self._by_hash[key], self._hash_of[dst] = dst, key
        self.refs[block] = 0
        heapq.heappush(self._free, block)
        return dst

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
        """Block `src`'s keys and values into block `dst` (every layer, either tier)."""
        for i in range(len(self.k)):
            for a, b in zip(self._block(i, src), self._block(i, dst), strict=True):
                b.copy_(a, non_blocking=True)

    def _block(self, i: int, block: int) -> list[torch.Tensor]:
        """Layer i's rows of `block`: keys, values (and their scales), in its tier."""
        bs = self.block_size
        if self.on_host(block):
            tier, at = self.host[i], (block - self.n_blocks) * bs
            tensors = [tier.k, tier.v] + ([tier.k_scale, tier.v_scale] if self.quantized else [])
        else:
            at = block * bs
            tensors = [self.k[i], self.v[i]]
            if self.quantized:
                tensors += [self.k_scale[i], self.v_scale[i]]
        return [t[at : at + bs] for t in tensors if t is not None]

    def host_pages(self, i: int) -> HostPages | None:
        """Layer i's host tier, for the attention kernels (None: the pool has none)."""
        return self.host[i] if self.host else None

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
    # the linear-attention layers' state for its tokens (a recurrent model's: Qwen3-Next)
    recurrent: RecurrentState | None = None

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
        """The first tier's blocks `tokens` more tokens need beyond those held (and the copy
        of a shared block they would write into), less those that go to the host tier as
        they do (a resident window)."""
        new = max(self.pool.blocks_for(self.length + tokens) - len(self.blocks), 0)
        i = self.length // self.block_size
        shared = self.length % self.block_size and i < len(self.blocks)
        moving = min(len(self._leaving(self.length + tokens)), self.pool.free_host_blocks)
        return max(new + int(bool(shared) and self.pool.refs[self.blocks[i]] > 1) - moving, 0)

    def own_blocks(self) -> int:
        """The first tier's blocks no other cache holds (what releasing this one gives
        back there)."""
        pool = self.pool
        return sum(1 for b in self.blocks if pool.refs[b] == 1 and not pool.on_host(b))

    def _leaving(self, length: int) -> list[int]:
        """The indices of the blocks that go to the host tier once the cache reaches
        `length`: written ones wholly before its newest `window` tokens, in the first tier,
        held by this cache alone."""
        pool, bs = self.pool, self.block_size
        if not pool.window:
            return []
        end = min(self.length, length - pool.window) // bs  # blocks wholly before both
        return [i for i in range(min(end, len(self.blocks)))
                if not pool.on_host(self.blocks[i]) and pool.refs[self.blocks[i]] == 1]  # fmt: skip

    def _move_out(self, length: int) -> None:
        """Move the blocks `_leaving(length)` names to the host tier (while it has room)."""
        for i in self._leaving(length):
            moved = self.pool.to_host(self.blocks[i])
            if moved is None:
                return
            self.blocks[i] = moved
            self._write_table(i, [moved])

    def reserve(self, length: int) -> None:
        """Hold blocks for the first `length` positions (taken from the pool; raises
        `KVPoolFull`, nothing taken, if it has too few), the block the next token is
        written into its own (copied first where it is shared or registered)."""
        if length > self.capacity:
            raise ValueError(f"{length} tokens exceed the KV cache of {self.capacity}")
        if length > self.length:
            self._own_last()
            self._move_out(length)
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
        self.recurrent = None  # no recurrent state stands for shared blocks

    def seal(self, scope: str) -> None:
        """Register the full blocks not yet registered, under `scope` (after a step)."""
        bs = self.block_size
        for i in range(len(self.keys), self.length // bs):
            key = block_key(self.keys[-1] if self.keys else None, scope,
                            self.tokens[i * bs : (i + 1) * bs])  # fmt: skip
            self.pool.register(self.blocks[i], key)
            self.keys.append(key)

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens; the blocks past it go back to the pool
        (a recurrent state, which cannot be cut back, with them)."""
        if self.recurrent is not None and self.recurrent.length != min(self.length, length):
            self.recurrent = None
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

    def gather(self, i: int, end: int, device: torch.device) -> list[torch.Tensor]:
        """Layer i's keys and values (and their scales, int8) of positions 0..end-1, gathered
        from either tier onto `device` (a prefill chunk's way in to torch attention)."""
        pool, bs = self.pool, self.block_size
        rows = self.rows(0, end, device)
        tier = pool.host_pages(i)
        pairs = [(pool.k[i], tier.k if tier else None), (pool.v[i], tier.v if tier else None)]
        if pool.quantized:
            pairs += [(pool.k_scale[i], tier.k_scale if tier else None),
                      (pool.v_scale[i], tier.v_scale if tier else None)]  # fmt: skip
        return [gather_rows(t, rows, bs, h, pool.n_blocks) for t, h in pairs]

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
