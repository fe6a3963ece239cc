"""A sequence's recurrent state for the layers that keep one instead of KV (Gated DeltaNet:
`stratad.model.graph.deltanet`), beside its KV cache (`KVCache.recurrent`).

The state stands for exactly the cache's first `length` tokens: unlike KV blocks it cannot be
cut back to fewer tokens or shared as a prefix, so `KVCache.truncate` and `adopt` drop it,
and a pass over a non-empty cache without it fails rather than compute from a wrong state.
"""

from __future__ import annotations

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
