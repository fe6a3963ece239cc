"""The KV cache of one sequence: preallocated per-layer key and value buffers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stratad.model.spec import ModelSpec


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [max_len, n_kv_heads, D]
    v: list[torch.Tensor]
    length: int = 0  # tokens whose keys and values are stored
    tokens: list[int] = field(default_factory=list)  # the ids behind them (for prefix reuse)

    @classmethod
    def allocate(
        cls, spec: ModelSpec, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (max_len, spec.n_kv_heads, spec.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.n_layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.n_layers)]
        return cls(k, v)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

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
