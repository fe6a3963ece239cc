"""The offload engine's decode step captured once as a CUDA graph and replayed per token.

The step's inputs (token, position) live in two device tensors the graph reads, and its
outputs (logits, routed ids) in the tensors the capture produced. Attention reads the length
on the device, so one capture serves every position of one KV cache; a new cache is captured
anew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stratad.engine.kv import KVCache
from stratad.engine.passes import Decode

if TYPE_CHECKING:
    from stratad.engine.offload import OffloadForward


class DecodeGraph:
    def __init__(self, engine: OffloadForward) -> None:
        self.engine = engine
        self._graph: torch.cuda.CUDAGraph | None = None
        self._cache: KVCache | None = None

    def replay(self, token: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [1, V], routed ids [layers, k]) of one step, in the graph's own tensors."""
        if self._graph is None or self._cache is not cache:
            self._capture(cache)
        self._tok.fill_(token)
        self._pos.fill_(cache.length)
        assert self._graph is not None
        self._graph.replay()
        return self._logits, self._ids

    def _capture(self, cache: KVCache) -> None:
        e = self.engine
        self._tok = torch.zeros(1, dtype=torch.long, device=e.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=e.device)
        self._pos.fill_(cache.length)
        stream = torch.cuda.Stream(e.device)
        stream.wait_stream(torch.cuda.current_stream(e.device))
        with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
            for _ in range(2):
                e._run(self._tok, self._pos, cache, Decode())
        torch.cuda.current_stream(e.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits, self._ids = e._run(self._tok, self._pos, cache, Decode())
        self._graph, self._cache = graph, cache
