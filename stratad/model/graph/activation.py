"""The gated activation of a model's feed-forward blocks: an object the spec holds
(`ModelSpec.activation`). `SiluGlu`: silu(gate) * up (llama-style). `ClampedSwiGlu`
(gpt-oss): the gate clamped from above and the up from both sides at `limit`, then
gate * sigmoid(alpha * gate) * (up + 1), as transformers' GptOssExperts and llama.cpp's
swiglu_oai compute it."""

from __future__ import annotations

import msgspec
import torch


class SiluGlu(msgspec.Struct, frozen=True, tag="silu"):
    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate) * up

    def describe(self) -> str:
        return "SiLU-gated"


class ClampedSwiGlu(msgspec.Struct, frozen=True, tag="clamped_swiglu"):
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        return g * torch.sigmoid(self.alpha * g) * (up.clamp(-self.limit, self.limit) + 1)

    def describe(self) -> str:
        return f"clamped SwiGLU (alpha {self.alpha:g}, limit {self.limit:g})"


Activation = SiluGlu | ClampedSwiGlu
SILU = SiluGlu()
