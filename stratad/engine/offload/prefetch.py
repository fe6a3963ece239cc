"""Speculative expert prefetch for decode (`engine.expert_prefetch`: `auto`, the default, is on
with the copy path while some experts live outside VRAM).

A decode step's misses for layer i+1 are known only after layer i+1's router, so their
fetch cannot overlap anything of that layer, and the link idles while every layer computes.
This guesses them one layer early: as soon as layer i has routed, layer i+1's router is
applied to the hidden state as it stands (its input lacks layer i's expert output and layer
i+1's attention, which the residual stream usually outweighs). The guessed experts that miss
VRAM are copied into a prefetch buffer while layer i computes. When layer i+1 routes, its
table is the layer's table with the guessed experts pointing at the prefetch buffer, so the
fetch kernel only copies the misses that were not guessed.

Three streams, so that neither the link nor the compute waits on the other's bookkeeping:

    main   ... route(i) ──────────── experts(i) ... route(i+1) ─ wait(copy i+1) ─ experts(i+1)
    guess        └─ score(i), guess(i+1), table(i+1) ─┐
    copy                        copy(i) ... ──────────└─ copy(i+1) into buf[(i+1) % 2] ─ event

The copy stream runs one layer's copy after another, so the link stays busy; the main stream
waits only for the event of the layer it is about to compute (never for the copy of the
next). The copy runs on at most `kernels.prefetch.programs` programs per blob, which leave
the SMs to the main stream's kernels.

A wrong guess costs link time, never correctness: an expert not prefetched is fetched as
usual. Two buffers alternate by layer parity; the copy for layer i+1 starts after layer i
has routed, which is after layer i-1 (the previous reader of the same buffer) computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.experts.expert_fetch import FetchConfig, fetch_experts
from stratad.engine.offload.experts import ExpertLayouts
from stratad.store.tiers.address_table import AddressTable


@dataclass
class _Guess:
    ids: torch.Tensor  # [1, k] int32, the guessed experts
    table: torch.Tensor  # [E, 3] the layer's table, the guessed misses at their copies
    copied: torch.cuda.Event | None  # recorded on the copy stream after the copy (GPU only)


class ExpertPrefetch:
    def __init__(
        self,
        experts: AddressTable,
        layouts: ExpertLayouts,
        route: Callable[[int, torch.Tensor], torch.Tensor],
        k: int,
        config: FetchConfig,
        host_span: tuple[int, int],
        enabled: bool,
    ) -> None:
        """`route(layer, x)`: the experts [1, k] int32 that layer's router picks for the
        hidden state x [1, H] (the guess); `host_span`: the RAM copy's address range, which
        the copy kernel reads; `enabled`: guess at all (the engine's copy path is on and no
        expert of a step lives only in the file)."""
        self.experts, self.route, self.config, self.host_span = experts, route, config, host_span
        self.layouts = layouts
        rows = k if enabled else 0
        self.enabled = enabled
        device = experts.device
        self.buf = torch.zeros((2, rows, experts.slot_bytes), dtype=torch.uint8,
                               device=device)  # fmt: skip
        on_gpu = self.enabled and device.type == "cuda"
        self.guess_stream = torch.cuda.Stream(device) if on_gpu else None
        self.copy_stream = torch.cuda.Stream(device) if on_gpu else None
        self._guess: dict[int, _Guess] = {}  # layer -> its guess, until the layer takes it
        # whether this pass forked the side streams: only then may `finish` join them (in a
        # graph capture, waiting on a stream the capture never forked is an error)
        self._forked = False
        # on the device (the captured step updates them): routed experts that were guessed, all
        self.score = torch.zeros(2, dtype=torch.int64, device=device)

    def after_route(
        self, layer: int, x: torch.Tensor, routed: torch.Tensor, pcie_frac: float
    ) -> None:
        """`layer` has routed one token to `routed` [1, k] from the hidden state x [1, H]:
        score that layer's guess, guess the next layer's experts and start copying them
        (not with a CPU share of the misses: the host reads the routing then)."""
        if not self.enabled or pcie_frac < 1.0:
            return
        device = self.experts.device
        nxt = layer + 1 if layer + 1 < self.experts.layers.stop else None
        if self.guess_stream is None or self.copy_stream is None:  # eager, on one stream
            self._score(layer, routed)
            if nxt is not None:
                ids, table = self._plan(nxt, x)
                self._copy(nxt, ids, table, None)
            return
        main = torch.cuda.current_stream(device)
        self.guess_stream.wait_stream(main)  # x and routed are ready; buf[nxt % 2] was read
        self._forked = True
        with torch.cuda.stream(self.guess_stream):
            self._score(layer, routed)
            planned = self._plan(nxt, x) if nxt is not None else None
        x.record_stream(self.guess_stream)
        routed.record_stream(self.guess_stream)
        if nxt is None or planned is None:
            return
        ids, table = planned
        self.copy_stream.wait_stream(self.guess_stream)
        with torch.cuda.stream(self.copy_stream):
            self._copy(nxt, ids, table, torch.cuda.Event())
        for t in (ids, table):
            t.record_stream(self.copy_stream)
            t.record_stream(main)

    def _plan(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The guessed experts of `layer` and a copy of its table for the copy to fill in."""
        return self.route(layer, x), self.experts.table[layer].clone()

    def _copy(
        self, layer: int, ids: torch.Tensor, table: torch.Tensor, event: torch.cuda.Event | None
    ) -> None:
        t = self.experts
        _, rows = fetch_experts(ids, t.table[layer], self.host_span, self.buf[layer % 2],
                                self.layouts.copy_bytes(layer), self.config)  # fmt: skip
        table[ids[0].long()] = rows  # rows of guessed hits repeat their VRAM address
        if event is not None:
            event.record()
        self._guess[layer] = _Guess(ids, table, event)

    def _score(self, layer: int, routed: torch.Tensor) -> None:
        guess = self._guess.get(layer)
        if guess is not None:
            self.score[0] += (routed[0][:, None] == guess.ids[0][None, :]).any(1).sum()
            self.score[1] += routed.numel()

    def table(self, layer: int) -> torch.Tensor:
        """The layer's address table, the guessed experts pointing at their prefetched copy
        (the current stream waits for that layer's copy, and only for it)."""
        guess = self._guess.pop(layer, None)
        if guess is None:
            return self.experts.table[layer]
        if guess.copied is not None:
            torch.cuda.current_stream(self.experts.device).wait_event(guess.copied)
        return guess.table

    def finish(self) -> None:
        """End of a pass: the current stream joins the side streams if the pass forked them
        (a captured graph must; a pass that made no guess, such as a step of several
        sequences, has nothing to join and must not wait on streams its capture never saw)."""
        if self._forked and self.guess_stream is not None and self.copy_stream is not None:
            main = torch.cuda.current_stream(self.experts.device)
            main.wait_stream(self.guess_stream)
            main.wait_stream(self.copy_stream)
        self._forked = False

    def accuracy(self) -> float:
        """The share of routed experts that were guessed, since the last `reset_score`."""
        right, total = self.score.tolist()
        return right / total if total else 0.0

    def reset_score(self) -> None:
        self.score.zero_()
