"""The offload engine's decode step captured as a CUDA graph and replayed per token.

The step's inputs (B tokens, their positions) live in two device tensors the graph reads,
and its outputs (logits, routed ids) in the tensors the capture produced. Attention reads
the lengths on the device, so one capture serves every position of the same B caches: a
batch whose sequences stay the same replays one graph for all of its steps. The last few
captures are kept (each holds its own intermediate buffers); a new set of caches is
captured anew.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stratad.engine.kv import KVCache

KEPT = 4  # captures kept, least recently replayed dropped first

Step = Callable[
    [torch.Tensor, torch.Tensor, Sequence[KVCache]], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class _Capture:
    caches: tuple[KVCache, ...]  # held, so that their identity stays theirs
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor
    pos: torch.Tensor
    logits: torch.Tensor
    ids: torch.Tensor


class DecodeGraph:
    def __init__(self, step: Step, device: torch.device) -> None:
        """`step(tokens [B], positions [B], caches)` -> (logits [B, V], ids): the eager pass
        the graph records."""
        self.step, self.device = step, device
        self._captures: OrderedDict[tuple[int, ...], _Capture] = OrderedDict()
        self.captured = 0  # captures made so far

    def replay(
        self, tokens: list[int], caches: Sequence[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, V], routed ids) of one step, in the graph's own tensors."""
        key = tuple(id(c) for c in caches)
        cap = self._captures.get(key)
        if cap is None or any(a is not b for a, b in zip(cap.caches, caches, strict=True)):
            cap = self._capture(tuple(caches))
            self._captures[key] = cap
            while len(self._captures) > KEPT:
                self._captures.popitem(last=False)
        self._captures.move_to_end(key)
        if len(caches) == 1:  # no host-to-device copy for the common case
            cap.tok.fill_(tokens[0])
            cap.pos.fill_(caches[0].length)
        else:
            cap.tok.copy_(torch.tensor(tokens))
            cap.pos.copy_(torch.tensor([c.length for c in caches]))
        cap.graph.replay()
        return cap.logits, cap.ids

    def _capture(self, caches: tuple[KVCache, ...]) -> _Capture:
        b, device = len(caches), self.device
        tok = torch.zeros(b, dtype=torch.long, device=device)
        pos = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
            for _ in range(2):
                self.step(tok, pos, caches)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, ids = self.step(tok, pos, caches)
        self.captured += 1
        return _Capture(caches, graph, tok, pos, logits, ids)
