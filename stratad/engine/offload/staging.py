"""Prefill's expert staging: every expert of the next layer copied into VRAM while the
current layer computes.

A prefill chunk of more than a few tokens routes to nearly every expert, so each layer's blobs
(from their VRAM slot, or page-locked RAM) are copied whole into one of two staging buffers on
a side stream (a layer whose experts are all in slots in one gather); the layer waits for its
buffer, dequantizes it to the compute dtype and frees it for the layer after next, and `moe`
runs the chunk through them as grouped GEMMs. On a GPU the dequantization is one Triton launch
per projection: split Q4_0 (`kernels.formats.dequant`) into three output buffers reused by
every layer (the layer's grouped GEMMs read them on the same stream before the next layer's
launches overwrite them), the other types (`kernels.formats.dequant_blocks`) into fresh ones.
"""

from __future__ import annotations

import torch

from kernels.formats.dequant import DEQUANT_DTYPES, DequantConfig, dequant_q4_0_split
from kernels.formats.dequant_blocks import dequant_blocks
from kernels.formats.quant import QType
from stratad.engine.offload.experts import ExpertLayouts, dequant_blobs
from stratad.engine.offload.grouped import grouped_glu
from stratad.host_copy import to_device
from stratad.model.graph.activation import SILU, Activation
from stratad.store.tiers.address_table import AddressTable


class ExpertStaging:
    def __init__(
        self, experts: AddressTable, layouts: ExpertLayouts, dtype: torch.dtype,
        dequant: DequantConfig, glu: Activation = SILU,
    ) -> None:  # fmt: skip
        """`experts`: where each blob is (VRAM slot, RAM copy, the file) and the side stream
        the copies run on; `layouts`: the blobs'; `dtype`: the compute dtype the blobs are
        dequantized to; `glu`: the experts' gated activation (the model's)."""
        self.experts, self.layouts, self.dtype, self.dequant = experts, layouts, dtype, dequant
        self.glu = glu
        self.n_experts = experts.table.shape[1]
        self._buf: torch.Tensor | None = None  # [2, E, blob bytes], allocated on first use
        self._ready: dict[int, torch.cuda.Event | None] = {}  # layer -> its copy is done
        self._freed: list[torch.cuda.Event | None] = [None, None]  # buffer -> last read done
        self._out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # GPU only
        # the file tier's blobs on their way in: [2, E, blob bytes] page-locked, and the copy
        # that last read each half
        self._bounce: torch.Tensor | None = None
        self._bounce_free: list[torch.cuda.Event | None] = [None, None]

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [E, F, H], up, down [E, H, F]) in the compute dtype, allocated on first use."""
        if self._out is None:
            e = self.experts
            f, h = self.layouts.ffn, self.layouts.hidden

            def empty(rows: int, cols: int) -> torch.Tensor:
                return torch.empty((self.n_experts, rows, cols), dtype=self.dtype, device=e.device)

            self._out = (empty(f, h), empty(f, h), empty(h, f))
        return self._out

    def buffers(self) -> torch.Tensor:
        if self._buf is None:
            e = self.experts
            self._buf = torch.empty(
                (2, self.n_experts, e.slot_bytes), dtype=torch.uint8, device=e.device
            )
        return self._buf

    def begin(self, layer: int) -> None:
        """A new chunk: start with its first layer."""
        self._ready.clear()
        self._freed = [None, None]
        self.prefetch(layer)

    def prefetch(self, layer: int) -> None:
        """Start copying the layer's blobs into buffer layer % 2 (on the side stream on a GPU,
        after that buffer's previous reader)."""
        e = self.experts
        buf, after = self.buffers()[layer % 2], self._freed[layer % 2]
        slot_of, host = e.slot_of[layer], e.ram
        files = [x for x in range(len(buf)) if x not in slot_of and not host.has(layer, x)]
        bounce = self._read_files(layer, files)
        row_of = {x: r for r, x in enumerate(files)}
        sources = [
            e.slots[slot_of[x]] if x in slot_of
            else bounce[row_of[x]] if x in row_of
            else host.blob(layer, x)
            for x in range(len(buf))
        ]  # fmt: skip
        # every expert in a VRAM slot (all resident): one gather, not a copy per blob
        gathered = len(slot_of) == len(buf)
        if e.side is None:
            _stage(buf, sources, e.slots, slot_of, gathered)
            self._ready[layer] = None
            return
        with torch.cuda.stream(e.side):
            if after is not None:
                e.side.wait_event(after)
            _stage(buf, sources, e.slots, slot_of, gathered)
            done = torch.cuda.Event()
            done.record()
        self._ready[layer] = done
        if files:
            self._bounce_free[layer % 2] = done

    def _read_files(self, layer: int, experts: list[int]) -> torch.Tensor:
        """The layer's experts that only the file holds, read on the host (while the GPU
        computes the previous layer) into page-locked rows of bounce buffer layer % 2, once
        that buffer's last copy has left."""
        e = self.experts
        if not experts:
            return torch.empty(0, dtype=torch.uint8)
        if self._bounce is None:
            pin = e.device.type == "cuda"
            self._bounce = torch.empty((2, self.n_experts, e.slot_bytes), dtype=torch.uint8,
                                       pin_memory=pin)  # fmt: skip
        freed = self._bounce_free[layer % 2]
        if freed is not None:
            freed.synchronize()
        rows = self._bounce[layer % 2]
        for row, x in enumerate(experts):
            e.ram.file_read(layer, x, rows[row])
        return rows[: len(experts)]

    def take(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [E, F, H], up, down [E, H, F]) of the layer in the compute dtype; its
        buffer is free again once this is queued. On a GPU they are the reused `outputs()`:
        valid until the next call."""
        e = self.experts
        ready = self._ready.get(layer)
        if ready is not None:
            torch.cuda.current_stream(e.device).wait_event(ready)
        lay, buf = self.layouts[layer], self.buffers()[layer % 2]
        fast = buf.is_cuda and self.dtype in DEQUANT_DTYPES
        outs = self.outputs() if fast else None

        def deq(k: int) -> torch.Tensor:
            lo, hi, rows, cols = lay.spans()[k]
            qtype = lay.qtypes[k]
            if outs is None:  # the CPU: torch (Triton would run in its slow interpreter)
                return dequant_blobs(buf, lay, k, self.dtype)
            if qtype == QType.Q4_0 and lay.is_split(qtype):
                return dequant_q4_0_split(buf[:, lo:hi], rows, cols, self.dtype, out=outs[k],
                                          config=self.dequant)  # fmt: skip
            # GGUF blocks (a view), or split Q6_K's blocks put back (a copy)
            blocks = lay.blocks(qtype, buf[:, lo:hi], rows, cols).reshape(buf.shape[0], -1)
            return dequant_blocks(blocks, qtype, rows, cols, self.dtype)

        out = (deq(0), deq(1), deq(2))
        if e.side is not None:
            freed = torch.cuda.Event()
            freed.record()
            self._freed[layer % 2] = freed
        return out

    def moe(
        self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The layer's routed-expert output [T, H] for a chunk: its rows grouped by expert,
        one grouped GEMM per projection over the staged experts (`bias`: the experts' gate
        and up [E, 2, F], down [E, H], added to each row by its expert)."""
        e = self.experts
        t, k = ids.shape
        flat = ids.reshape(-1).long()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        gate, up, down = self.take(layer)
        tokens = order // k
        xs = h[tokens]  # [T*k, H], grouped by expert
        rows_bias = None
        if bias is not None:  # each row's expert's
            expert = flat[order]
            rows_bias = (bias[0][expert, 0], bias[0][expert, 1], bias[1][expert])
        rows = grouped_glu(xs, counts, gate, up, down, self.glu, rows_bias)
        scaled = rows.float() * weights.reshape(-1)[order, None]
        out = torch.zeros((t, self.layouts.hidden), dtype=torch.float32, device=e.device)
        out.index_add_(0, tokens, scaled)
        return out.to(self.dtype)


def _stage(
    buf: torch.Tensor, sources: list[torch.Tensor], slots: torch.Tensor,
    slot_of: dict[int, int], gathered: bool,
) -> None:  # fmt: skip
    """A layer's blobs into its staging buffer [E, slot bytes], on the current stream: with
    every expert in a slot (`gathered`) one gather from the slots, else a copy per blob."""
    if gathered:
        ids = to_device([slot_of[x] for x in range(len(buf))], torch.long, buf.device)
        torch.index_select(slots, 0, ids, out=buf)
        return
    for dst, src in zip(buf, sources, strict=True):
        dst[: src.numel()].copy_(src, non_blocking=True)
