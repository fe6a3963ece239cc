"""The offload engine's Gated DeltaNet layers (Qwen3-Next's linear attention,
`stratad.model.graph.deltanet`): the in-projection of q, k, v, the output gate z and the
gates' logits ba as one product, the causal convolution, the gated delta rule in one launch
per sequence (`kernels.layers.delta_rule`, its state in place), the per-head norm times
silu(z), and the projection back.

Each sequence's recurrent state (`stratad.engine.recurrent`) rides on its cache. A pass takes
every cache's state off it at `begin` and gives it back, standing for the pass's tokens too,
at `finish`: a pass that fails midway leaves its caches with none, so the next pass over them
fails as stale instead of continuing a half-updated state. The states are one row per
sequence: a pass never holds two rows of one sequence (`OffloadForward.row_tokens` is 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as fn

from kernels.layers.delta_rule import DeltaRuleConfig, gated_delta_rule
from stratad.engine.kv import KVCache
from stratad.engine.offload.dense import DeltaNetLayer, DenseLayer
from stratad.engine.passes import Pass
from stratad.engine.recurrent import RecurrentState, state_for
from stratad.engine.reference.deltanet import causal_conv
from stratad.model.graph.deltanet import GatedDeltaNet

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class OffloadDeltaNet:
    def __init__(
        self, net: GatedDeltaNet, eps: float, linear: Linear, norm: Norm,
        config: DeltaRuleConfig | None = None,
    ) -> None:  # fmt: skip
        """`linear(x, weight)` and `norm(x, weight, eps)`: the engine's projections (GEMV for
        a few tokens) and RMS norm."""
        self.net, self.eps, self.linear, self.norm = net, eps, linear, norm
        self.config = config or DeltaRuleConfig()
        self.held: list[RecurrentState] = []  # each sequence's state during a pass

    def begin(self, caches: Sequence[KVCache]) -> None:
        """A pass over `caches` (one row or span each, in order): their states, taken off."""
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a pass of a recurrent model takes one row or span per sequence")
        self.held = [state_for(c.recurrent, c.length) for c in caches]
        for c in caches:
            c.recurrent = None

    def finish(self, caches: Sequence[KVCache], step: Pass) -> None:
        """The pass is done: each cache's state back on it, standing for its new tokens too
        (before the caller counts them into the cache's length)."""
        for c, held, rows in zip(caches, self.held, step.rows(), strict=True):
            held.length = c.length + rows.stop - rows.start
            c.recurrent = held
        self.held = []

    def __call__(self, w: DenseLayer, i: int, h: torch.Tensor, step: Pass) -> torch.Tensor:
        """Layer i's output [T, H] for its normed input h [T, H], each sequence's rows
        continuing its state."""
        net, dn = self.net, w.deltanet
        assert dn is not None, f"layer {i} is not a linear-attention layer"
        t = h.shape[0]
        mixed, z, ba = self.linear(h, w.qkv).split(
            [net.conv_dim, net.value_dim, 2 * net.v_heads], dim=-1
        )
        outs = [self._rule(dn, i, mixed[rows], ba[rows], held)
                for rows, held in zip(step.rows(), self.held, strict=True)]  # fmt: skip
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, Hv, Dv] float32
        o = self.norm(o, dn.norm, self.eps) * fn.silu(z.float().view(t, net.v_heads, net.v_dim))
        return self.linear(o.reshape(t, net.value_dim).to(h.dtype), w.o)

    def _rule(
        self, dn: DeltaNetLayer, i: int, mixed: torch.Tensor, ba: torch.Tensor,
        held: RecurrentState,
    ) -> torch.Tensor:  # fmt: skip
        """One sequence's rows: the convolution after its held inputs, then the rule from its
        state (updated in place): [T, Hv, Dv] float32."""
        net, t = self.net, mixed.shape[0]
        out, held.conv[i] = causal_conv(mixed.float(), dn.conv, held.conv.get(i))
        q, k, v = out.split([net.key_dim, net.key_dim, net.value_dim], dim=-1)
        state = held.state.get(i)
        if state is None:
            state = held.state[i] = mixed.new_zeros(
                (net.v_heads, net.k_dim, net.v_dim), dtype=torch.float32
            )
        return gated_delta_rule(
            q.view(t, net.k_heads, net.k_dim), k.view(t, net.k_heads, net.k_dim),
            v.view(t, net.v_heads, net.v_dim), ba, dn.dt_bias, dn.a, state, self.config,
        )  # fmt: skip
