"""A sequence's recurrent state for the layers that keep one instead of KV (Gated DeltaNet:
`stratad.model.graph.deltanet`), beside its KV cache (`KVCache.recurrent`).

The state stands for exactly the cache's first `length` tokens: unlike KV blocks it cannot be
cut back to fewer tokens or shared as a prefix, so `KVCache.truncate` and `adopt` drop it,
and a pass over a non-empty cache without it fails rather than compute from a wrong state.
A prefix is reused whole or not at all: the prefix store keeps a copy (`HeldState`) beside a
snapshot's KV, for exactly the snapshot's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stratad.model.spec import ModelSpec


class StaleState(RuntimeError):
    """A recurrent model's cache holds tokens its recurrent state does not stand for."""


@dataclass
class RecurrentState:
    length: int = 0  # the tokens folded in
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [C, K - 1] inputs
    state: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hv, Dk, Dv]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (self.conv, self.state) for t in d.values())

    def map(self, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> RecurrentState:
        """A new state of the same length, each layer's tensors `fn(layer, tensor)`."""
        return RecurrentState(self.length, {i: fn(i, t) for i, t in self.conv.items()},
                              {i: fn(i, t) for i, t in self.state.items()})  # fmt: skip

    def copy(self) -> RecurrentState:
        """A copy on the same devices (a checkpoint before a pass that may be undone)."""
        return self.map(lambda _, t: t.clone())


@dataclass(frozen=True)
class HeldState:
    """A recurrent state copied off its device (a prefix snapshot's, on the host), and the
    device each layer's tensors came from."""

    host: RecurrentState
    devices: dict[int, torch.device]

    @classmethod
    def of(cls, s: RecurrentState) -> HeldState:
        """A copy of `s` on the host. From a GPU it goes into page-locked memory without
        waiting: the next step, which updates the state in place, is queued after it on the
        same stream."""
        return cls(s.map(lambda _, t: _to_host(t)), {i: t.device for i, t in s.state.items()})

    @property
    def length(self) -> int:
        return self.host.length

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def restored(self) -> RecurrentState:
        """A new state on the devices it came from, equal to the held one."""
        return self.host.map(lambda i, t: t.to(self.devices[i]))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def state_bytes(spec: ModelSpec) -> int:
    """One sequence's recurrent state on the device (float32): every linear-attention layer's
    held convolution inputs [C, K - 1] and state [Hv, Dk, Dv]; 0 for a model without one."""
    net = spec.deltanet
    if net is None:
        return 0
    per_layer = net.conv_dim * (net.conv_kernel - 1) + net.v_heads * net.k_dim * net.v_dim
    return 4 * per_layer * sum(net.linear(i) for i in range(spec.n_layers))


def state_for(current: RecurrentState | None, length: int) -> RecurrentState:
    """The state a pass over a cache of `length` tokens continues from: a new one for an
    empty cache, else `current` if it stands for those tokens."""
    if length == 0:
        return RecurrentState()
    if current is None or current.length != length:
        held = "none" if current is None else f"one of {current.length}"
        raise StaleState(f"the cache holds {length} tokens and its recurrent state is {held}:"
                         " a recurrent model's cache is not cut back or shared")  # fmt: skip
    return current
