"""The KV cache of one sequence: preallocated per-layer key and value buffers, and their
addresses on each device that holds some of them (the decode kernels find every sequence's
cache of a batch through them, in one launch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stratad.model.spec import ModelSpec


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [max_len, n_kv_heads, D]
    v: list[torch.Tensor]
    length: int = 0  # tokens whose keys and values are stored
    tokens: list[int] = field(default_factory=list)  # the ids behind them (for prefix reuse)
    # per device: [layers, 2] int64, each layer's (k, v) buffer address (made once: a decode
    # step gathers them on the device, which a CUDA graph can replay)
    addrs: dict[torch.device, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pairs = [[k.data_ptr(), v.data_ptr()] for k, v in zip(self.k, self.v, strict=True)]
        table = torch.tensor(pairs, dtype=torch.int64)
        self.addrs = {d: table.to(d) for d in {t.device for t in self.k}}

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        zeroed: bool = True,
    ) -> KVCache:
        """`zeroed` False: the buffers as allocated, for a forward that never reads past
        `length` (on the host their pages then commit only as tokens reach them, so the
        working caches of short requests take little RAM)."""
        shape = (max_len, spec.n_kv_heads, spec.head_dim)
        new = torch.zeros if zeroed else torch.empty
        k = [new(shape, device=device, dtype=dtype) for _ in range(spec.n_layers)]
        v = [new(shape, device=device, dtype=dtype) for _ in range(spec.n_layers)]
        return cls(k, v)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    def same_kind(self, other: KVCache) -> bool:
        """Whether the two caches' buffers have one shape and dtype (a kernel reading several
        caches through their addresses takes the strides of one)."""
        a, b = self.k[0], other.k[0]
        return a.shape == b.shape and a.dtype == b.dtype and len(self.k) == len(other.k)

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (the buffers are reused as they are)."""
        self.length = min(self.length, length)
        del self.tokens[self.length :]

    def common_prefix(self, tokens: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n


def kv_addresses(caches: Sequence[KVCache], device: torch.device) -> torch.Tensor:
    """The caches' buffer addresses [L, B, 2] on `device`: one gather there, which a captured
    graph replays."""
    return torch.stack([c.addrs[device] for c in caches], 1)
