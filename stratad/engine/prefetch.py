"""Speculative expert prefetch for decode (`engine.expert_prefetch`, off by default).

A decode step's misses for layer i+1 are known only after layer i+1's router, so their
fetch cannot overlap anything of that layer, and the link idles while every layer computes.
This guesses them one layer early: as soon as layer i has routed, layer i+1's router is
applied to the hidden state as it stands (its input lacks layer i's expert output and layer
i+1's attention, which the residual stream usually outweighs). The guessed experts that miss
VRAM are copied into a prefetch buffer on a stream of their own while layer i computes. When
layer i+1 routes, its table is the layer's table with the guessed experts pointing at the
prefetch buffer, so the fetch kernel only copies the misses that were not guessed.

A wrong guess costs link time, never correctness: an expert not prefetched is fetched as
usual. Two buffers alternate by layer parity; the prefetch for layer i+1 starts after layer
i has routed, which is after layer i-1 (the previous reader of the same buffer) computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as fn

from kernels.expert_fetch import fetch_experts
from stratad.engine.layers import route

if TYPE_CHECKING:
    from stratad.engine.offload import OffloadForward


class ExpertPrefetch:
    def __init__(self, engine: OffloadForward) -> None:
        self.engine = engine
        e = engine
        rows = e.spec.n_experts_used if e.config.prefetch and e._fetch_buf.shape[0] else 0
        self.enabled = rows > 0
        self.buf = torch.zeros((2, rows, e.layout.nbytes), dtype=torch.uint8, device=e.device)
        on_gpu = self.enabled and e.device.type == "cuda"
        self.stream = torch.cuda.Stream(e.device) if on_gpu else None
        self._guess: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (ids, table rows)
        # on the device (the captured step updates them): routed experts that were guessed, all
        self.score = torch.zeros(2, dtype=torch.int64, device=e.device)

    def start(self, layer: int, x: torch.Tensor) -> None:
        """Guess `layer`'s experts from the hidden state x [1, H] and start copying the misses."""
        e = self.engine
        if not self.enabled or layer >= e.layer_ids.stop:
            return
        w, spec = e.layers[layer], e.spec
        h = e.norm_fn(x, w.ffn_norm, spec.rms_eps)
        _, ids = route(fn.linear(h, w.router), spec.n_experts_used, spec.norm_topk_prob)
        ids = ids.to(torch.int32)
        args = (e.table[layer], e._host_span, self.buf[layer % 2], e.layout.nbytes,
                e.config.kernels.fetch)  # fmt: skip
        if self.stream is None:
            _, rows = fetch_experts(ids, *args)
        else:
            main = torch.cuda.current_stream(e.device)
            self.stream.wait_stream(main)  # the guess is computed; the buffer's reader is done
            with torch.cuda.stream(self.stream):
                _, rows = fetch_experts(ids, *args)
            ids.record_stream(self.stream)
            rows.record_stream(main)
        self._guess[layer] = (ids, rows)

    def table(self, layer: int, routed: torch.Tensor) -> torch.Tensor:
        """The layer's address table, the guessed experts pointing at their prefetched copy;
        `routed` [1, k], the layer's actual experts, only counts how many were guessed."""
        e = self.engine
        guess = self._guess.pop(layer, None)
        if guess is None:
            return e.table[layer]
        ids, rows = guess
        self.score[0] += (routed[0][:, None] == ids[0][None, :]).any(1).sum()
        self.score[1] += routed.numel()
        if self.stream is not None:
            torch.cuda.current_stream(e.device).wait_stream(self.stream)
        table = e.table[layer].clone()
        table[ids[0].long()] = rows  # rows of guessed hits repeat their VRAM address
        return table

    def accuracy(self) -> float:
        """The share of routed experts that were guessed, since the last `reset_score`."""
        right, total = self.score.tolist()
        return right / total if total else 0.0

    def reset_score(self) -> None:
        self.score.zero_()
