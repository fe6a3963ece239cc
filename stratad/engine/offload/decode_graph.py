"""The offload engine's decode step captured as a CUDA graph and replayed per token.

A step is R rows of one token each, row r at its position in cache r: one token per
sequence, or several rows of one sequence (a short prompt, a drafted window). The step's
inputs live in device tensors the graph reads: the R tokens, their positions and, where the
pass reads every KV cache through the block tables, the rows' tables [R, max_blocks]
(`KVCache.table`). Attention reads the lengths on the device, so one capture serves every
position; with the tables an input too, one capture per row count and pool serves every set
of caches, so a request joining or leaving the batch replays another size's graph instead of
capturing anew. Row counts are padded up to a few sizes (`SIZES`) by repeating the last row,
which writes the same key and value to the same place and whose outputs are dropped, so
prompts of every short length share a dozen captures. Caches of several pools (or a pass
that writes a cache through its own table) are captured per set of caches, as the graph then
holds their tables. The last few captures are kept (each holds its own intermediate buffers).
A recurrent model's states change with every step, not only at the step's own positions: a
capture's warm-up steps run inside the engine's `preserve` block, which puts them back.

A capture that fails runs that step eagerly instead, with one WARNING: a request never fails
for a graph. The same key is not captured again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from stratad.engine.batch import decode_inputs
from stratad.engine.kv import KVCache, block_tables
from stratad.host_copy import to_device

log = logging.getLogger("stratad.engine")

# the row counts captured: a step of R rows replays the smallest size of at least R
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
KEPT = len(SIZES) + 4  # captures kept, least recently replayed dropped first

# step(tokens [B], positions [B], caches, block tables [B, max_blocks] or None) -> (logits, ids)
Step = Callable[
    [torch.Tensor, torch.Tensor, Sequence[KVCache], torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass
class _Capture:
    caches: tuple[KVCache, ...]  # captured per set of caches: held, so their identity stays
    pool: object  # the pool whose tensors the graph reads: held, so its id stays its own
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor
    pos: torch.Tensor
    tables: torch.Tensor | None  # [B, max_blocks], filled before each replay (per size)
    logits: torch.Tensor
    ids: torch.Tensor


class DecodeGraph:
    def __init__(
        self, step: Step, device: torch.device, by_table: Callable[[Sequence[KVCache]], bool],
        preserve: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:  # fmt: skip
        """`step(tokens, positions, caches, tables)` -> (logits [B, V], ids): the eager pass
        the graph records. `by_table(caches)`: whether, given their block tables, the pass
        reads and writes those caches through them only (a capture then serves any caches of
        its size and pool). `preserve()`: a block around a capture's warm-up steps that puts
        back what they change beyond rewriting the step's own keys and values (a recurrent
        model's states)."""
        self.step, self.device, self.by_table, self.preserve = step, device, by_table, preserve
        self._captures: OrderedDict[Hashable, _Capture] = OrderedDict()
        self._failed: set[Hashable] = set()  # keys whose capture failed: run eagerly
        self.captured = 0  # captures made so far
        self.warned = False

    def _key(self, caches: Sequence[KVCache]) -> tuple[Hashable, bool]:
        """(the capture's key, whether it is per size: by the caches' block tables)."""
        first = caches[0]
        if self.by_table(caches):
            return ("size", len(caches), id(first.pool), first.max_blocks), True
        return ("caches", tuple(id(c) for c in caches)), False

    def replay(
        self, tokens: list[int] | torch.Tensor, pos: list[int], caches: Sequence[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [R, V], routed ids [layers, R * k]) of a step of R rows, views of the
        graph's own tensors (or the eager step's, where the capture failed). `tokens` on the
        device are copied there, ordered after the work that makes them."""
        rows = len(caches)
        size = next((n for n in SIZES if n >= rows), rows)
        if size > rows:  # padded with copies of the last row
            extra = size - rows
            if isinstance(tokens, torch.Tensor):
                tokens = torch.cat([tokens, tokens[-1:].expand(extra)])
            else:
                tokens = [*tokens, *[tokens[-1]] * extra]
            pos = [*pos, *[pos[-1]] * extra]
            caches = [*caches, *[caches[-1]] * extra]
        logits, ids = self._replay(tokens, pos, caches)
        return logits[:rows], ids[:, : ids.shape[1] // size * rows]

    def prepare(self, cache: KVCache, one_row: bool = False) -> int:
        """Capture every row count up to the room left in `cache` for steps on caches of its
        pool and capacity (rows of `cache` at its next positions, which it gives back after),
        so that no request waits for a capture or for Triton to compile its shapes: the
        captures made. `one_row`: every row at the cache's next position (a recurrent
        model's, whose state is one row's: the rows past the first are padding)."""
        start, before = cache.length, self.captured
        room = min(SIZES[-1], cache.capacity - start, cache.pool.free_blocks * cache.block_size)
        if one_row:
            room = SIZES[-1] if room else 0
        try:
            cache.reserve(start + (min(room, 1) if one_row else room))
            for n in (n for n in SIZES if n <= room):
                pos = [start] * n if one_row else list(range(start, start + n))
                self.replay([0] * n, pos, [cache] * n)
        finally:
            cache.truncate(start)
        return self.captured - before

    def _replay(
        self, tokens: list[int] | torch.Tensor, pos: list[int], caches: Sequence[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key, by_size = self._key(caches)
        if key in self._failed:
            return self._eager(tokens, pos, caches)
        cap = self._captures.get(key)
        if cap is not None and not by_size and any(
            a is not b for a, b in zip(cap.caches, caches, strict=True)
        ):
            cap = None  # another set of caches with the identities of freed ones
        if cap is None:
            try:
                cap = self._capture(tuple(caches), pos, by_size)
            except Exception as err:  # noqa: BLE001 (any failure: the step runs eagerly)
                self._failed.add(key)
                if not self.warned:
                    self.warned = True
                    log.warning(
                        "decode graph: the capture of a step of %d sequences failed (%s: %s);"
                        " such steps run without a graph (slower, same tokens)",
                        len(caches), type(err).__name__, err,
                    )  # fmt: skip
                return self._eager(tokens, pos, caches)
            self._captures[key] = cap
            while len(self._captures) > KEPT:
                self._captures.popitem(last=False)
        self._captures.move_to_end(key)
        self._fill(cap, tokens, pos, caches)
        cap.graph.replay()
        return cap.logits, cap.ids

    def _eager(
        self, tokens: list[int] | torch.Tensor, pos: list[int], caches: Sequence[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step(*decode_inputs(tokens, pos, self.device), caches, None)

    def _fill(
        self,
        cap: _Capture,
        tokens: list[int] | torch.Tensor,
        pos: list[int],
        caches: Sequence[KVCache],
    ) -> None:
        """The step's inputs into the capture's tensors (before its replay)."""
        if isinstance(tokens, torch.Tensor):  # on the device already
            cap.tok.copy_(tokens)
        elif len(caches) == 1:  # no host-to-device copy for the common case
            cap.tok.fill_(tokens[0])
        else:
            cap.tok.copy_(to_device(tokens, torch.long, cap.tok.device))
        if len(caches) == 1:
            cap.pos.fill_(pos[0])
        else:
            cap.pos.copy_(to_device(pos, torch.long, cap.pos.device))
        if cap.tables is not None:
            cap.tables.copy_(block_tables(caches, cap.tables.device))

    def _capture(
        self, caches: tuple[KVCache, ...], at: list[int], by_size: bool
    ) -> _Capture:
        b, device = len(caches), self.device
        tok = torch.zeros(b, dtype=torch.long, device=device)
        pos = torch.tensor(at, dtype=torch.long, device=device)
        tables = block_tables(caches, pos.device) if by_size else None
        stream = torch.cuda.Stream(device)
        with self.preserve():  # (its copies queued before the warm-up's stream waits)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
                for _ in range(2):
                    self.step(tok, pos, caches, tables)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits, ids = self.step(tok, pos, caches, tables)
        self.captured += 1
        held = () if by_size else caches  # a per-size capture holds no cache alive
        return _Capture(held, caches[0].pool, graph, tok, pos, tables, logits, ids)

