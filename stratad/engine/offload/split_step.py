"""A decode step with a CPU share of the misses, captured in pieces between the host's turns.

With `pcie_frac` below 1 the host must see each layer's routing before it can compute the CPU's
share, so the step cannot be one CUDA graph. Run eagerly, it spent most of its time launching:
a3b at 4 GiB on the H200 decoded 13 tok/s split against 58.6 captured whole, with attention
and the router alone at 31 ms a step. Here each layer is two captured pieces, replayed in
order from one memory pool:

- A(i): the previous layer's CPU part (a page-locked host buffer) copied in and added with the
  GPU's parts, the norm, attention, the norm, the router; the routed ids, their weights and
  the normed hidden state copied out to page-locked host buffers.
- B(i): the GPU's share: the slots the host marks for the CPU (a page-locked mask copied in)
  are skipped; hits from VRAM, the other misses over PCIe; the shared expert.

The host replays A(i), waits for it, marks the CPU's slots, replays B(i), and computes the
CPU's share while B(i) runs; A(i + 1) picks its result up. A last piece adds the last layer's
parts and computes the logits. Each host buffer is written only after the stream has consumed
its previous contents (the wait after each A). On a CPU, or without graphs, the same pieces
run eagerly in the same order (so the CPU tests cover the protocol).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from stratad.engine.kv import KVCache

KEPT = 4  # captures kept, least recently replayed dropped first

Slots = list[tuple[int, int]]


@dataclass(frozen=True)
class SplitParts:
    """The engine's pieces the step runs (not the engine: each piece takes its tensors)."""

    layers: range
    top_k: int
    hidden: int
    embed: Callable[[torch.Tensor], torch.Tensor]  # tokens [B] -> x [B, H]
    begin: Callable[[torch.Tensor, Sequence[KVCache]], None]  # positions [B], once per pass
    # (layer, x, parts | None, pos, caches) -> (x, normed h, weights [B, k], ids [B, k] int32)
    attend_route: Callable[
        [int, torch.Tensor, torch.Tensor | None, torch.Tensor, Sequence[KVCache]],
        tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ]
    # (layer, h, ids with the CPU's slots at -1, weights) -> parts [B, P, H] float32
    gpu_experts: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, parts) -> logits
    # (layer, host ids [B][k]) -> the (token, slot) pairs the CPU computes
    cpu_slots: Callable[[int, list[list[int]]], Slots]
    # (layer, host ids, h [B, H] f32, weights [B][k], slots, out [B, H] f32 to add into)
    cpu_compute: Callable[[int, list[list[int]], torch.Tensor, list[list[float]], Slots,
                           torch.Tensor], None]
    stage: Callable[[str], AbstractContextManager[object]]  # the engine's stage timer


@dataclass
class _Buffers:
    """One capture's tensors: the inputs, what the pieces produced, the host's side."""

    tok: torch.Tensor
    pos: torch.Tensor
    ids_host: torch.Tensor  # [B, k] int32, page-locked
    w_host: torch.Tensor  # [B, k] float32
    h_host: torch.Tensor  # [B, H] float32
    mask_host: torch.Tensor  # [B, k] bool: the CPU's slots
    cpu_host: torch.Tensor  # [B, H] float32: the CPU's part of the layer
    x: torch.Tensor | None = None
    h: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    parts: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    routed: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Capture:
    caches: tuple[KVCache, ...]  # held, so that their identity stays theirs
    bufs: _Buffers
    pieces: list[Callable[[], None]]  # A(first), B(first), A(next) ... B(last), the head


class SplitStep:
    def __init__(
        self, parts: SplitParts, device: torch.device, graphs: bool,
        preserve: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:  # fmt: skip
        """`preserve()`: a block around a capture's warm-up passes that puts back what they
        change beyond rewriting the step's own keys and values (a recurrent model's states,
        as `DecodeGraph`'s)."""
        self.p, self.device, self.preserve = parts, device, preserve
        self.graphs = graphs and device.type == "cuda"
        self._captures: OrderedDict[tuple[int, ...], _Capture] = OrderedDict()
        self.captured = 0

    def __call__(
        self, tokens: list[int], pos: list[int], caches: Sequence[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [R, V], routed ids [layers, R * k]) of rows of one token each, row r at
        pos[r] of caches[r]."""
        cap = self._capture_for(tuple(caches), pos)
        b = cap.bufs
        b.tok.copy_(torch.tensor(tokens))
        b.pos.copy_(torch.tensor(pos))
        self._run(cap)
        assert b.logits is not None
        routed = torch.stack([b.routed[i] for i in self.p.layers])
        return b.logits, routed.reshape(routed.shape[0], -1)

    def _run(self, cap: _Capture) -> None:
        """The pieces in order, the host's turn after each A."""
        b, pieces = cap.bufs, cap.pieces
        for n, i in enumerate(self.p.layers):
            pieces[2 * n]()  # A(i)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            host_ids = b.ids_host.tolist()
            slots = self.p.cpu_slots(i, host_ids)
            b.mask_host.zero_()
            for t, k in slots:
                b.mask_host[t, k] = True
            pieces[2 * n + 1]()  # B(i): queued, the GPU runs it while the CPU computes
            b.cpu_host.zero_()
            if slots:
                with self.p.stage("experts (CPU)"):
                    weights = b.w_host.tolist()
                    self.p.cpu_compute(i, host_ids, b.h_host, weights, slots, b.cpu_host)
        pieces[-1]()

    # -- the pieces -------------------------------------------------------------------------

    def _pieces(self, b: _Buffers, caches: tuple[KVCache, ...]) -> list[Callable[[], None]]:
        p, device = self.p, self.device

        def with_cpu_part() -> torch.Tensor:
            assert b.parts is not None
            cpu = b.cpu_host.to(device, non_blocking=True)[:, None]
            return torch.cat([b.parts, cpu.to(b.parts.dtype)], dim=1)

        def attend(i: int) -> Callable[[], None]:
            def run() -> None:
                if i == p.layers.start:
                    b.x, parts = p.embed(b.tok), None
                    p.begin(b.pos, caches)
                else:
                    parts = with_cpu_part()
                assert b.x is not None
                b.x, b.h, b.weights, b.ids = p.attend_route(i, b.x, parts, b.pos, caches)
                b.routed[i] = b.ids
                b.ids_host.copy_(b.ids, non_blocking=True)
                b.w_host.copy_(b.weights.float(), non_blocking=True)
                b.h_host.copy_(b.h.float(), non_blocking=True)

            return run

        def experts(i: int) -> Callable[[], None]:
            def run() -> None:
                assert b.h is not None and b.ids is not None and b.weights is not None
                cpu = b.mask_host.to(device, non_blocking=True)
                b.parts = p.gpu_experts(i, b.h, b.ids.masked_fill(cpu, -1), b.weights)

            return run

        def head() -> None:
            assert b.x is not None
            b.logits = p.finish(b.x, with_cpu_part())

        pieces: list[Callable[[], None]] = []
        for i in p.layers:
            pieces += [attend(i), experts(i)]
        return [*pieces, head]

    def _buffers(self, n: int) -> _Buffers:
        pin = self.device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        k, hidden = self.p.top_k, self.p.hidden
        return _Buffers(
            tok=torch.zeros(n, dtype=torch.long, device=self.device),
            pos=torch.zeros(n, dtype=torch.long, device=self.device),
            ids_host=host(n, k, dtype=torch.int32), w_host=host(n, k, dtype=torch.float32),
            h_host=host(n, hidden, dtype=torch.float32), mask_host=host(n, k, dtype=torch.bool),
            cpu_host=host(n, hidden, dtype=torch.float32),
        )  # fmt: skip

    def _capture_for(self, caches: tuple[KVCache, ...], pos: list[int]) -> _Capture:
        key = tuple(id(c) for c in caches)
        cap = self._captures.get(key)
        if cap is None or any(a is not b for a, b in zip(cap.caches, caches, strict=True)):
            cap = self._capture(caches, pos)
            self._captures[key] = cap
            while len(self._captures) > KEPT:
                self._captures.popitem(last=False)
        self._captures.move_to_end(key)
        return cap

    def _capture(self, caches: tuple[KVCache, ...], pos: list[int]) -> _Capture:
        """The pieces of one set of caches (rows at `pos`): eager ones, or each captured once
        (after two eager warm-up passes, which compile the kernels) into graphs sharing one
        pool."""
        bufs = self._buffers(len(caches))
        eager = _Capture(caches, bufs, self._pieces(bufs, caches))
        if not self.graphs:
            return eager
        bufs.pos.copy_(torch.tensor(pos))
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        replays: list[Callable[[], None]] = []
        with self.preserve():  # (its copies queued before the warm-up's stream waits)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(eager)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for piece in eager.pieces:  # in order: each captures the tensors the last produced
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    piece()
                replays.append(graph.replay)
        self.captured += 1
        return _Capture(caches, bufs, replays)
