"""How RoPE's frequencies stretch past the context a model was trained on: each kind is an
object the spec holds (`ModelSpec.rope_scaling`), and each gives the inverse frequencies of
a head's rotated pairs and the factor cos and sin are multiplied by. Every engine rotates
from tables built from these (`stratad.engine.reference.layers.rope_tables`).

`Unscaled`: theta ** (-2i / d). `Linear`: positions divided by `factor` (the frequencies
over `factor`). `Yarn` (arXiv 2309.00071, as Hugging Face's `_compute_yarn_parameters` and
llama.cpp's `rope_yarn` compute it): the pairs that turn fewer than `beta_slow` times over
the original context are interpolated (over `factor`), those turning more than `beta_fast`
times kept, a linear ramp between (its ends floored and ceiled), and cos and sin scaled by
`attn_factor` (0.1 ln(factor) + 1 unless the model states its own).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec
import torch

if TYPE_CHECKING:  # the spec holds a scaling: no import at run time (a cycle)
    from stratad.model.spec import ModelSpec


def _plain(dim: int, theta: float) -> torch.Tensor:
    """[dim / 2] float64: theta ** (-2i / dim)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


class Unscaled(msgspec.Struct, frozen=True, tag="none"):
    def frequencies(self, dim: int, theta: float) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [dim / 2] float64, the factor on cos and sin)."""
        return _plain(dim, theta), 1.0

    def describe(self) -> str:
        return "none"


class Linear(msgspec.Struct, frozen=True, tag="linear"):
    factor: float

    def frequencies(self, dim: int, theta: float) -> tuple[torch.Tensor, float]:
        return _plain(dim, theta) / self.factor, 1.0

    def describe(self) -> str:
        return f"linear x{self.factor:g}"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a stretch of `factor`: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class Yarn(msgspec.Struct, frozen=True, tag="yarn"):
    factor: float
    original_context: int  # the context the model was trained on
    attn_factor: float  # cos and sin times this
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends floored and ceiled (llama.cpp always does)

    def frequencies(self, dim: int, theta: float) -> tuple[torch.Tensor, float]:
        def pair(turns: float) -> float:  # the pair index that turns `turns` times
            return dim * math.log(self.original_context / (turns * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = pair(self.beta_fast), pair(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low)
                / max(high - low, 0.001)).clamp(0, 1)  # fmt: skip
        kept = 1 - ramp  # 1: the pair turns fast enough to keep its frequency
        plain = _plain(dim, theta)
        return plain / self.factor * (1 - kept) + plain * kept, self.attn_factor

    def describe(self) -> str:
        return f"YaRN x{self.factor:g} of {self.original_context:,}"


RopeScaling = Unscaled | Linear | Yarn
UNSCALED = Unscaled()


def configured(spec: ModelSpec, kind: str, factor: float, original: int) -> ModelSpec:
    """The spec with `model.rope_scaling` applied: "file" keeps the model's own; "none" none;
    "linear" or "yarn" by `factor` over `original` (0: the stated context), whose context is
    then `factor` times the original (at least the stated one)."""
    if kind == "file":
        return spec
    if kind == "none":
        return replace(spec, rope_scaling=UNSCALED)
    base = original or spec.context_length
    scaling: RopeScaling = (Linear(factor) if kind == "linear"
                            else Yarn(factor, base, yarn_mscale(factor)))  # fmt: skip
    return replace(spec, rope_scaling=scaling,
                   context_length=max(spec.context_length, int(base * factor)))  # fmt: skip
