"""What a model is: its hyper-parameters (`ModelSpec`) and its named weights (`Model`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels.formats.quant import QTensor
from stratad.model.graph.activation import SILU, Activation
from stratad.model.graph.deltanet import GatedDeltaNet
from stratad.model.graph.mla import Mla
from stratad.model.graph.rope_scaling import UNSCALED, RopeScaling
from stratad.model.graph.routing import SOFTMAX, GroupedSoftmax, Routing, Sigmoid


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
    routing: Routing = SOFTMAX  # how a MoE layer scores and chooses (`stratad.model.graph.routing`)
    expert_scale: float = 1.0  # the chosen experts' weights times this (GLM, DeepSeek)
    dense_layers: int = 0  # a MoE model's first layers with a dense FFN of width `ffn`
    rope_dim: int = 0  # the leading dims of each head that RoPE rotates; 0: all of them
    rope_scaling: RopeScaling = UNSCALED  # past the trained context (`model.rope_scaling`)
    activation: Activation = SILU  # the feed-forward blocks' gate (`model.graph.activation`)
    attn_sinks: bool = False  # a learned logit per query head joins each softmax (gpt-oss)
    sliding_window: int = 0  # the keys a sliding layer's query sees (itself and those before)
    swa_pattern: int = 0  # layer i slides where i % swa_pattern < swa_pattern - 1 (llama.cpp's)
    mla: Mla | None = None  # multi-head latent attention (DeepSeek; `stratad.model.graph.mla`)
    v_head_dim: int = 0  # a value head's dims where they differ from a key's (0: head_dim)
    attn_scale: float = 1.0  # the attention scores' scale times this (DeepSeek's YaRN)
    deltanet: GatedDeltaNet | None = None  # linear-attention layers (Qwen3-Next)
    attn_gate: bool = False  # q's projection also gives a sigmoid gate on each head's output

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def moe_layer(self, i: int) -> bool:
        """Whether layer i routes to experts (past a MoE model's leading dense layers)."""
        return self.is_moe and i >= self.dense_layers

    @property
    def moe_layers(self) -> range:
        return range(self.dense_layers, self.n_layers) if self.is_moe else range(0)

    def linear_layer(self, i: int) -> bool:
        """Whether layer i mixes tokens by Gated DeltaNet (no KV: a recurrent state)."""
        return self.deltanet is not None and self.deltanet.linear(i)

    @property
    def kv_layers(self) -> int:
        """The layers that cache keys and values (every one but a linear-attention layer)."""
        return sum(1 for i in range(self.n_layers) if not self.linear_layer(i))

    def window(self, i: int) -> int:
        """The sliding window of layer i's attention; 0: it sees the whole context."""
        n = self.swa_pattern
        return self.sliding_window if n and i % n < n - 1 else 0

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE turns in each head (MLA: the rotated part of each query and key)."""
        if self.mla is not None:
            return self.mla.rope_dim
        return self.rope_dim or self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """A value head's dims (a key's unless the spec says otherwise)."""
        return self.v_head_dim or self.head_dim

    def validate(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads is not a multiple of {self.n_kv_heads}")
        if self.is_moe and not 0 < self.n_experts_used <= self.n_experts:
            raise ModelError(f"top-{self.n_experts_used} routing over {self.n_experts} experts")
        if self.qk_norm not in ("none", "head", "full"):
            raise ModelError(f"unknown qk_norm {self.qk_norm!r}")
        if self.mla is not None and not (0 < self.mla.rope_dim < self.head_dim
                                         and self.mla.rope_dim % 2 == 0):  # fmt: skip
            raise ModelError(f"MLA rotates {self.mla.rope_dim} of a key's {self.head_dim} dims")
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ModelError(f"RoPE over {self.rope_dim} of a head's {self.head_dim} dims")
        if self.dense_layers and not (self.is_moe and self.dense_layers < self.n_layers
                                      and self.ffn > 0):  # fmt: skip
            raise ModelError(f"{self.dense_layers} leading dense layers of {self.n_layers}"
                             f" (dense FFN width {self.ffn})")  # fmt: skip
        r = self.routing
        if isinstance(r, Sigmoid | GroupedSoftmax) and self.is_moe:
            per = self.n_experts // r.groups if self.n_experts % r.groups == 0 else 0
            least = 2 if isinstance(r, Sigmoid) else 1  # a sigmoid group ranks by its best two
            if not (per >= least and 1 <= r.groups_used <= r.groups
                    and self.n_experts_used <= per * r.groups_used):  # fmt: skip
                raise ModelError(f"top-{self.n_experts_used} routing within {r.groups_used} of"
                                 f" {r.groups} groups of {self.n_experts} experts")  # fmt: skip


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
            for layer in self.spec.moe_layers
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
