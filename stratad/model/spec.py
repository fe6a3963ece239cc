"""What a model is: its hyper-parameters (`ModelSpec`) and its named weights (`Model`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels.formats.quant import QTensor


class ModelError(ValueError):
    """A model that cannot be loaded; the message names the file, tensor or key at fault."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters, independent of the file format."""

    arch: str  # registry key, e.g. "llama", "qwen3moe"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    context_length: int
    ffn: int = 0  # dense FFN width (0 when every layer is MoE)
    rope_interleaved: bool = False  # GGUF llama/mixtral rotate pairs (2i, 2i+1); others halves
    tie_embeddings: bool = False
    attn_bias: bool = False  # q/k/v projections carry a bias (qwen2 family)
    qk_norm: str = "none"  # "none" | "head" (qwen3: per head) | "full" (olmoe: whole projection)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def validate(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads is not a multiple of {self.n_kv_heads}")
        if self.is_moe and not 0 < self.n_experts_used <= self.n_experts:
            raise ModelError(f"top-{self.n_experts_used} routing over {self.n_experts} experts")
        if self.qk_norm not in ("none", "head", "full"):
            raise ModelError(f"unknown qk_norm {self.qk_norm!r}")


@dataclass(frozen=True)
class ExpertUnit:
    """One routed expert of one layer: the unit the expert store places in a tier."""

    layer: int
    expert: int


@dataclass
class Model:
    """A spec plus its weights, keyed by Hugging Face names.

    Routed experts are stacked per layer (`...mlp.experts.gate_proj` is [E, F, H]) so that
    one expert is `tensors[name][e]`, a view onto the file's bytes.
    """

    spec: ModelSpec
    tensors: dict[str, QTensor]
    source: Path
    metadata: dict[str, Any] = field(default_factory=dict)  # GGUF metadata or HF config

    def expert_units(self) -> list[ExpertUnit]:
        return [
            ExpertUnit(layer, expert)
            for layer in range(self.spec.n_layers)
            for expert in range(self.spec.n_experts)
        ]

    def dense_values(self) -> int:
        """Values in every weight but the routed experts (what lives on the compute device)."""
        return sum(math.prod(t.shape) for n, t in self.tensors.items() if ".experts." not in n)

    def tensor(self, name: str) -> QTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.source}: missing tensor {name!r}") from None
