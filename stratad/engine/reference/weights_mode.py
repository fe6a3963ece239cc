"""How a torch-sequenced forward holds its weights: a mode object the forward asks for each
projection (`linear`) and the token embedding (`embedding`).

- `FloatWeights`: dequantized once to the compute dtype on the device: the reference
  (`ReferenceForward`'s definition of what the model computes).
- `QuantWeights`: the GGUF blocks themselves (memory-mapped from the file, or the store's
  tiers for experts), each product computed by the compiled CPU kernels
  (`kernels.cpu.experts`: int8 activations per block of 32, as llama.cpp does). A weight the
  kernels do not read (rows not a multiple of 32; every GGUF type Strata reads is read) is
  dequantized to float32 instead, and counted (`fallbacks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kernels.cpu.dense import DenseStack
from kernels.cpu.experts import CpuExperts, PreparedMoE
from kernels.cpu.moe_stack import MoEStack
from kernels.formats.quant import QTensor
from stratad.config import EngineConfig
from stratad.engine.reference.cpu_stacks import dense_stack, moe_stack
from stratad.engine.reference.layers import attention, attention_by_row
from stratad.engine.reference.store_moe import ExpertProvider, StoreExperts
from stratad.engine.reference.store_stack import StoreStack
from stratad.model.spec import ModelSpec
from stratad.model.weights import LayerWeights, MoEWeights

Linear = Callable[[torch.Tensor], torch.Tensor]
Routed = PreparedMoE  # (x, ids, weights, out): out += the routed experts' weighted sum
# (q, k, v, start, sinks, window) -> out: `layers.attention`
Attention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None, int], torch.Tensor
]
# (x, k, v, start, cos, sin): every layer, x in place
LayerStack = DenseStack | MoEStack | StoreStack


@dataclass(frozen=True)
class FloatLinear:
    """x @ w.T with w [out, in] in the compute dtype."""

    w: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.T


class QuantLinear:
    """x @ W.T read from W's GGUF blocks by the CPU kernels; float32 out."""

    def __init__(self, q: QTensor, kernels: CpuExperts) -> None:
        self.q = q
        self.rows, self.cols = q.shape
        self._matmul = kernels.prepare(q.data.contiguous(), q.qtype, self.rows, self.cols)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x.reshape(-1, self.cols).float().contiguous())
        return out.reshape(*x.shape[:-1], self.rows)


@dataclass(frozen=True)
class FloatEmbedding:
    table: torch.Tensor  # [V, H] in the compute dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


class WeightMode(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def linear(self, t: QTensor) -> Linear: ...

    def embedding(self, t: QTensor) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def vector(self, t: QTensor) -> torch.Tensor: ...

    @property
    def attention(self) -> Attention: ...

    def layer_stack(
        self, spec: ModelSpec, layers: list[LayerWeights], store: ExpertProvider | None = None
    ) -> LayerStack | None: ...

    def routed(self, moe: MoEWeights) -> Routed | None: ...

    def store_routed(self, store: ExpertProvider) -> StoreExperts | None: ...


@dataclass(frozen=True)
class FloatWeights:
    device: torch.device
    dtype: torch.dtype
    name: str = "float weights (the reference)"
    attention: Attention = attention

    def float(self, t: QTensor) -> torch.Tensor:
        return t.dequantize().to(device=self.device, dtype=self.dtype)

    def linear(self, t: QTensor) -> Linear:
        return FloatLinear(self.float(t))

    def embedding(self, t: QTensor) -> FloatEmbedding:
        return FloatEmbedding(self.float(t))

    def vector(self, t: QTensor) -> torch.Tensor:
        return self.float(t)

    def layer_stack(
        self, spec: ModelSpec, layers: list[LayerWeights], store: ExpertProvider | None = None
    ) -> None:
        return None  # the reference runs its layers one torch op at a time

    def routed(self, moe: MoEWeights) -> None:
        return None  # the reference computes expert by expert

    def store_routed(self, store: ExpertProvider) -> None:
        return None  # and asks the store for one expert at a time


@dataclass
class QuantWeights:
    kernels: CpuExperts
    dtype: torch.dtype = torch.float32
    fallbacks: set[str] = field(default_factory=set)  # types dequantized instead
    # a prompt's tokens as decode computes them, whatever the chunks (see attention_by_row)
    attention: Attention = attention_by_row
    one_call: bool = True  # a model's layers in one kernel call where they allow it

    @property
    def name(self) -> str:
        cast = (f", {', '.join(sorted(self.fallbacks))} dequantized to float32 (rows the kernels"
                " do not read)" if self.fallbacks else "")  # fmt: skip
        n = self.kernels.threads
        rows = "; dense rows interleaved in eights" * self.kernels.interleaves
        return f"GGUF blocks read by the CPU kernels ({n} thread{'s' * (n != 1)}{rows}){cast}"

    def reads(self, t: QTensor) -> bool:
        return t.qtype in self.kernels.supported and len(t.shape) == 2 and t.shape[1] % 32 == 0

    def linear(self, t: QTensor) -> Linear:
        if self.reads(t):
            return QuantLinear(t, self.kernels)
        self.fallbacks.add(t.qtype.name)
        return FloatLinear(t.dequantize())

    def embedding(self, t: QTensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rows dequantized as they are looked up (the table stays in its blocks)."""
        if t.is_float:
            return lambda ids: t.data[ids].float()
        cols = t.shape[-1]
        return lambda ids: QTensor(t.data[ids], t.qtype, (ids.numel(), cols)).dequantize()

    def vector(self, t: QTensor) -> torch.Tensor:
        return t.dequantize()

    def routed(self, moe: MoEWeights) -> Routed | None:
        """A layer's routed experts from its stacks in one kernel call per step, where the
        kernels read the three stacks' types; else None: expert by expert."""
        ex = moe.experts
        stacks = (ex.gate, ex.up, ex.down)
        if not all(t.qtype in self.kernels.supported and len(t.shape) == 3 for t in stacks):
            return None
        _, ffn, hidden = ex.gate.shape
        if hidden % 32 or ffn % 32:
            return None
        qtypes = (ex.gate.qtype, ex.up.qtype, ex.down.qtype)
        gate, up, down = (t.data.contiguous() for t in stacks)
        return self.kernels.prepare_moe(gate, up, down, qtypes, hidden, ffn)

    def store_routed(self, store: ExpertProvider) -> StoreExperts:
        """A layer's routed experts from the store's tiers in one kernel call per step."""
        return StoreExperts(store, self.kernels)

    def layer_stack(
        self, spec: ModelSpec, layers: list[LayerWeights], store: ExpertProvider | None = None
    ) -> LayerStack | None:
        """Every layer in one kernel call per step where the model's layers allow it
        (`stratad/engine/reference/cpu_stacks.py`: all dense, or all MoE of routed experts; with a
        `store`, MoE layers whose experts it addresses in place: `store_stack.py`); else None:
        layer by layer (also with `one_call` off: the per-projection path, for tests)."""
        if not self.one_call:
            return None
        if store is not None:
            stack = moe_stack(self.kernels, self.reads, spec, layers, stacks=False)
            return None if stack is None else StoreStack.attach(stack, store)
        return dense_stack(self.kernels, self.reads, spec, layers) or moe_stack(
            self.kernels, self.reads, spec, layers
        )


def cpu_weights(engine: EngineConfig) -> QuantWeights:
    """The cpu engine's weights: the kernels on `engine.cpu_expert_threads` (else
    `engine.threads`, else every physical core); torch on one thread unless `engine.threads`
    says otherwise, as the kernels' team owns the cores and torch's small ops run faster alone
    (SmolLM2 prefill 80 -> 104-114 tok/s on the 2-core VM, decode alike)."""
    kernels = CpuExperts(engine.cpu_expert_threads or engine.threads or None,
                         interleave=engine.cpu_interleave)  # fmt: skip
    weights = QuantWeights(kernels)
    if not engine.threads:
        torch.set_num_threads(1)
    return weights
