"""The offload engine's Gated DeltaNet layers (Qwen3-Next's linear attention,
`stratad.model.graph.deltanet`): the in-projection of q, k, v, the output gate z and the
gates' logits ba as one product, the causal convolution, the gated delta rule (its state in
place), the per-head norm times silu(z), and the projection back. A prompt's span runs the
convolution and the rule once per sequence (`kernels.layers.delta_rule`, chunked where long);
a decode step runs each in one launch over every row (`kernels.layers.conv_rows`,
`gated_delta_rule_rows`), each row's state read and written at the address its row holds in
the step's address table.

Each sequence's recurrent state (`stratad.engine.recurrent`) rides on its cache. Its tensors
are the cache's for good (`held`: kept here per cache, zeroed for a new sequence, updated in
place), so a decode step captured as a CUDA graph replays on the same memory. A pass takes
every cache's state off it at `begin` and gives it back, standing for the pass's tokens too,
at `finish`: a pass that fails midway leaves its caches with none, so the next pass over them
fails as stale instead of continuing a half-updated state. A pass holds one row (or span) per
sequence (`OffloadForward.row_tokens` is 1); a row that repeats an earlier row's cache is a
captured step's padding (`decode_graph`: a copy of the last row): it gets that row's output
(so its keys and values, written to the same place, are the same) and leaves the state alone.
A capture's warm-up steps run eagerly: `preserved` puts the states back after them.

The address table (`_rows`, one buffer for good, [2 layers + 1, ROWS_MAX] int64 on the
device) is filled at `begin`, on the host before every pass (copied where it changed): per
layer the rows' held convolution inputs and states, the rows past the pass's sequences (a
captured step's padding) pointing at one scratch state, and the row each output row takes
(padding: the last sequence's). A decode step reads the table on the device, so one capture
per row count serves every set of caches, as the block tables do for the KV caches (its
attention layers' input, a quarter of each head rotated, is written through those tables).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as fn

from kernels.layers.conv_rows import causal_conv_rows
from kernels.layers.delta_rule import DeltaRuleConfig, gated_delta_rule, gated_delta_rule_rows
from stratad.engine.kv import KVCache
from stratad.engine.offload.decode_graph import SIZES
from stratad.engine.offload.dense import DeltaNetLayer, DenseLayer
from stratad.engine.offload.projection import GgufMatrix
from stratad.engine.passes import Pass
from stratad.engine.recurrent import RecurrentState, state_for
from stratad.engine.reference.deltanet import causal_conv
from stratad.host_copy import to_device
from stratad.model.graph.deltanet import GatedDeltaNet

ROWS_MAX = SIZES[-1]  # the most rows a decode step takes through the address table

Linear = Callable[[torch.Tensor, torch.Tensor | GgufMatrix], torch.Tensor]
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class OffloadDeltaNet:
    def __init__(
        self, net: GatedDeltaNet, layers: Sequence[int], eps: float, linear: Linear,
        norm: Norm, device: torch.device, config: DeltaRuleConfig | None = None,
    ) -> None:  # fmt: skip
        """`layers`: the model's linear-attention layers; `linear(x, weight)` and `norm(x,
        weight, eps)`: the engine's projections (GEMV for a few tokens) and RMS norm."""
        self.net, self.layers, self.eps, self.device = net, tuple(layers), eps, device
        self.linear, self.norm = linear, norm
        self.config = config or DeltaRuleConfig()
        # each cache's state tensors, for good (a captured step holds their addresses)
        self._own: weakref.WeakKeyDictionary[KVCache, RecurrentState] = (
            weakref.WeakKeyDictionary()
        )
        self.held: dict[int, RecurrentState] = {}  # id(cache) -> its state, during a pass
        n = len(self.layers)
        self._at = {layer: j for j, layer in enumerate(self.layers)}
        self._rows = torch.zeros(2 * n + 1, ROWS_MAX, dtype=torch.int64, device=device)
        self._filled: list[list[int]] = []  # the sequences' addresses the table holds
        self._scratch: RecurrentState | None = None  # padding rows' state (written, unread)
        self.rows = 0  # sequences the table holds for this pass (0: none, per sequence)

    def begin(self, caches: Sequence[KVCache]) -> None:
        """A pass over `caches` (one row or span each, in order): their states, taken off,
        and their addresses in the table."""
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a pass of a recurrent model takes one row or span per sequence")
        self.held = {id(c): self._state(c) for c in caches}
        for c in caches:
            c.recurrent = None
        self._fill([self.held[id(c)] for c in caches])

    def _fill(self, states: Sequence[RecurrentState]) -> None:
        """The address table for rows of `states` in order, every later row (a captured
        step's padding) the scratch state's, taking the last sequence's output. Each pass
        reads the sequences' own addresses alone (one per layer and tensor: the host's work a
        step); the table is copied where they changed."""
        n = len(states)
        tensors = [t for s in states for t in (*s.conv.values(), *s.state.values())]
        if not 0 < n <= ROWS_MAX or not all(t.is_contiguous() for t in tensors):
            self.rows = 0
            return
        own = [[s.conv[i].data_ptr() for s in states] for i in self.layers]
        own += [[s.state[i].data_ptr() for s in states] for i in self.layers]
        if own != self._filled:
            pad, scratch = ROWS_MAX - n, self._scratch_state()
            spare = [scratch.conv[i].data_ptr() for i in self.layers]
            spare += [scratch.state[i].data_ptr() for i in self.layers]
            table = [row + [at] * pad for row, at in zip(own, spare, strict=True)]
            table.append([*range(n), *[n - 1] * pad])
            self._rows.copy_(to_device(table, torch.int64, self.device))
            self._filled = own
        self.rows = n

    def _scratch_state(self) -> RecurrentState:
        if self._scratch is None:
            self._scratch = self._new_state()
        return self._scratch

    def _new_state(self) -> RecurrentState:
        net, state = self.net, RecurrentState()
        for i in self.layers:
            state.conv[i] = torch.zeros(net.conv_dim, net.conv_kernel - 1, device=self.device)
            state.state[i] = torch.zeros(net.v_heads, net.k_dim, net.v_dim, device=self.device)
        return state

    def finish(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> None:
        """The pass is done: each cache's state back on it, standing for its `tokens` new
        ones too (before the caller counts them into the cache's length)."""
        for c, n in zip(caches, tokens, strict=True):
            held = self.held[id(c)]
            held.length = c.length + n
            c.recurrent = held
        self.held = {}

    @contextmanager
    def preserved(self) -> Iterator[None]:
        """The held states as they are now, put back when the block ends (a capture's warm-up
        steps run the pass eagerly)."""
        saved = [(t, t.clone()) for s in self.held.values()
                 for t in (*s.conv.values(), *s.state.values())]  # fmt: skip
        try:
            yield
        finally:
            for t, was in saved:
                t.copy_(was)

    def _state(self, cache: KVCache) -> RecurrentState:
        """The state a pass over `cache` continues: its own tensors, zeroed for a new
        sequence; the one its cache holds (`state_for`: none is stale) past its start."""
        own = self._own.get(cache)
        if cache.length:
            held = state_for(cache.recurrent, cache.length)
            if own is None:  # (computed elsewhere: its tensors become this cache's own)
                own = self._own[cache] = held
            elif held is not own:
                for mine, theirs in ((own.conv, held.conv), (own.state, held.state)):
                    for i, t in theirs.items():
                        mine[i].copy_(t)
                own.length = held.length
            return own
        if own is None:
            own = self._own[cache] = self._new_state()
        for t in (*own.conv.values(), *own.state.values()):
            t.zero_()
        own.length = 0
        return own

    def __call__(
        self, w: DenseLayer, i: int, h: torch.Tensor, step: Pass, caches: Sequence[KVCache]
    ) -> torch.Tensor:
        """Layer i's output [T, H] for its normed input h [T, H], each sequence's rows
        continuing its state (a row repeating an earlier row's cache: padding, its output)."""
        net, dn = self.net, w.deltanet
        assert dn is not None, f"layer {i} is not a linear-attention layer"
        t = h.shape[0]
        mixed, z, ba = self.linear(h, w.qkv).split(
            [net.conv_dim, net.value_dim, 2 * net.v_heads], dim=-1
        )
        if step.decode and self.rows:
            o = self._decode_rows(dn, i, mixed, ba)
        else:
            o = self._spans(dn, i, mixed, ba, step, caches)
        o = self.norm(o, dn.norm, self.eps) * fn.silu(z.float().view(t, net.v_heads, net.v_dim))
        return self.linear(o.reshape(t, net.value_dim).to(h.dtype), w.o)

    def _decode_rows(
        self, dn: DeltaNetLayer, i: int, mixed: torch.Tensor, ba: torch.Tensor
    ) -> torch.Tensor:
        """A decode step's rows (one token each, padded or not) in one launch of each kernel
        through the address table: [T, Hv, Dv] float32, padding rows the last sequence's."""
        net, t, j, n = self.net, mixed.shape[0], self._at[i], len(self.layers)
        out = causal_conv_rows(mixed, dn.conv, self._rows[j, :t])
        q, k, v = out.split([net.key_dim, net.key_dim, net.value_dim], dim=-1)
        o = gated_delta_rule_rows(
            q.view(t, net.k_heads, net.k_dim), k.view(t, net.k_heads, net.k_dim),
            v.view(t, net.v_heads, net.v_dim), ba, dn.dt_bias, dn.a, self._rows[n + j, :t],
            self.config,
        )  # fmt: skip
        # (always gathered: a capture made without padding replays steps that have some)
        return o.index_select(0, self._rows[2 * n, :t])

    def _spans(
        self, dn: DeltaNetLayer, i: int, mixed: torch.Tensor, ba: torch.Tensor, step: Pass,
        caches: Sequence[KVCache],
    ) -> torch.Tensor:  # fmt: skip
        """Each sequence's rows through its own launches: [T, Hv, Dv] float32."""
        outs: list[torch.Tensor] = []
        done: dict[int, torch.Tensor] = {}  # id(cache) -> its row's output
        for rows, cache in zip(step.rows(), caches, strict=True):
            if id(cache) not in done:
                done[id(cache)] = self._rule(dn, i, mixed[rows], ba[rows], self.held[id(cache)])
            outs.append(done[id(cache)])  # (padding repeats its row: the same output)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _rule(
        self, dn: DeltaNetLayer, i: int, mixed: torch.Tensor, ba: torch.Tensor,
        held: RecurrentState,
    ) -> torch.Tensor:  # fmt: skip
        """One sequence's rows: the convolution after its held inputs, then the rule from its
        state, both updated in place: [T, Hv, Dv] float32."""
        net, t = self.net, mixed.shape[0]
        out, last = causal_conv(mixed.float(), dn.conv, held.conv[i])
        held.conv[i].copy_(last)
        q, k, v = out.split([net.key_dim, net.key_dim, net.value_dim], dim=-1)
        return gated_delta_rule(
            q.view(t, net.k_heads, net.k_dim), k.view(t, net.k_heads, net.k_dim),
            v.view(t, net.v_heads, net.v_dim), ba, dn.dt_bias, dn.a, held.state[i], self.config,
        )  # fmt: skip
