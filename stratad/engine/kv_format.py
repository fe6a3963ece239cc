"""How the KV cache stores keys and values: as computed, or quantized.

- `PLAIN`: in the pool's dtype (bf16 on a GPU, halves or floats on a CPU).
- `Int8KV`: int8 with one float32 scale per (token, KV head), symmetric: scale = max|x| / 127
  over the head's values, q = round(x / scale) (half to even) in -127..127
  (`kernels.formats.kv_int8`, whose layout the attention kernels read directly); llama.cpp's
  `-ctk q8_0` keeps a scale per 32 values instead.
- `Q4KV`: 4 bits with a float32 scale and minimum per 32 values of a head (as llama.cpp's
  `q4_1`): scale = (max - min) / 15, q = round((x - min) / scale) in 0..15. On the default
  model a symmetric form (scale = max|x| / 7) cost 28% of perplexity, this one 11% over
  2,048 tokens of the Python documentation (16 values a group: 6%).

`round_trip(x)` is what a reader of the stored form gets back for x [T, Hkv, D] (float32
arithmetic): the reference engine applies it to every key and value it writes, so its
attention sees exactly the quantized cache's values (what `bench.kv.kv_ppl` measures the
perplexity of). The GPU kernels store the ints and the scales themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.formats.kv_int8 import dequantize_kv, quantize_kv


@dataclass(frozen=True)
class PlainKV:
    """Keys and values as computed, in the pool's dtype."""

    name: str = "plain"

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class Int8KV:
    """int8, one scale per (token, KV head)."""

    name: str = "int8"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hkv, D] -> (int8 [T, Hkv, D], float32 scales [T, Hkv])."""
        return quantize_kv(x)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_kv(q, scale)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(*self.quantize(x)).to(x.dtype)


@dataclass(frozen=True)
class Q4KV:
    """4 bits, a scale and a minimum per `group` values of a KV head."""

    name: str = "q4"
    group: int = 32

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, Hkv, D] -> (ints 0..15 as uint8 [T, Hkv, D], float32 scales and minimums
        [T, Hkv, D / group]) (the kernels pack two ints a byte)."""
        t, h, d = x.shape
        if d % self.group:
            raise ValueError(f"head dim {d} is not a whole number of {self.group}-value groups")
        g = x.float().reshape(t, h, d // self.group, self.group)
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = (high - low) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - low) / safe).clamp(0, 15).to(torch.uint8)
        return q.reshape(t, h, d), scale[..., 0], low[..., 0]

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        t, h, d = q.shape
        g = q.reshape(t, h, d // self.group, self.group).float()
        return (g * scale[..., None] + low[..., None]).reshape(t, h, d)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(*self.quantize(x)).to(x.dtype)


KVFormat = PlainKV | Int8KV | Q4KV
PLAIN = PlainKV()
INT8 = Int8KV()
FORMATS: dict[str, KVFormat] = {f.name: f for f in (PLAIN, INT8, Q4KV())}
