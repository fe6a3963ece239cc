"""How the KV cache stores keys and values: as computed, or quantized.

- `PLAIN`: in the pool's dtype (bf16 on a GPU, halves or floats on a CPU).
- `Int8KV`: int8 with one float32 scale per (token, KV head), symmetric: scale = max|x| / 127
  over the head's values, q = round(x / scale) (half to even) in -127..127
  (`kernels.formats.kv_int8`, whose layout the attention kernels read directly); llama.cpp's
  `-ctk q8_0` keeps a scale per 32 values instead.
- `Q4KV`: 4 bits with a float16 scale and minimum per 32 values of a head (as llama.cpp's
  `q4_1`): scale = (max - min) / 15, q = round((x - min) / scale) in 0..15
  (`kernels.formats.kv_q4`, read directly by the offload engine's decode attention). On the
  default model a symmetric form (scale = max|x| / 7) cost 28% of perplexity, this one
  (with float32 scales) 11% over 2,048 tokens of the Python documentation (16 values a
  group: 6%).

`round_trip(x)` is what a reader of the stored form gets back for x [T, Hkv, D] (float32
arithmetic): the reference engine applies it to every key and value it writes, so its
attention sees exactly the quantized cache's values (what `bench.kv.kv_ppl` measures the
perplexity of). The GPU kernels store the ints and the scales themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.formats.kv_int8 import dequantize_kv, quantize_kv
from kernels.formats.kv_q4 import GROUP, check_dim, dequantize_kv4, quantize_kv4


@dataclass(frozen=True)
class Layout:
    """How a pool stores one row (a token's KV head) of keys or values: its codes' dtype and
    shape, and its scales' (None: none)."""

    codes: torch.dtype
    code_shape: tuple[int, ...]
    scales: torch.dtype | None = None
    scale_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of one row, codes and scales."""
        n = self.codes.itemsize * math.prod(self.code_shape)
        return n + (self.scales.itemsize * math.prod(self.scale_shape) if self.scales else 0)


@dataclass(frozen=True)
class PlainKV:
    """Keys and values as computed, in the pool's dtype."""

    name: str = "plain"

    def layout(self, head_dim: int, dtype: torch.dtype) -> Layout:
        return Layout(dtype, (head_dim,))

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class Int8KV:
    """int8, one scale per (token, KV head)."""

    name: str = "int8"

    def layout(self, head_dim: int, dtype: torch.dtype) -> Layout:
        return Layout(torch.int8, (head_dim,), torch.float32, ())

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hkv, D] -> (int8 [T, Hkv, D], float32 scales [T, Hkv])."""
        return quantize_kv(x)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_kv(q, scale)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(*self.quantize(x)).to(x.dtype)


@dataclass(frozen=True)
class Q4KV:
    """4 bits, a float16 scale and minimum per 32 values of a KV head
    (`kernels.formats.kv_q4`)."""

    name: str = "q4"

    def layout(self, head_dim: int, dtype: torch.dtype) -> Layout:
        check_dim(head_dim)
        return Layout(torch.uint8, (head_dim // 2,), torch.float16, (head_dim // GROUP, 2))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hkv, D] -> (codes uint8 [T, Hkv, D / 2], two a byte; float16 (scale,
        minimum) pairs [T, Hkv, D / 32, 2])."""
        return quantize_kv4(x)

    def dequantize(self, q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
        return dequantize_kv4(q, dm)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(*self.quantize(x)).to(x.dtype)


KVFormat = PlainKV | Int8KV | Q4KV
PLAIN = PlainKV()
INT8 = Int8KV()
Q4 = Q4KV()
FORMATS: dict[str, KVFormat] = {f.name: f for f in (PLAIN, INT8, Q4)}
