"""The file tier of an address table: experts with neither a VRAM slot nor a RAM copy.

Before a layer's fused kernels run (a decode step of the GPU engine), the host reads the layer's
routed ids (one synchronisation per layer, so such a step is not captured as a graph), reads the
experts that only the file holds into page-locked bounce rows, and points the layer's address
table at them for this step. The kernels then read them like any RAM copy. The rows are reused
by the next layer: its ids are read only after this layer's kernels, queued before its router,
have run.
"""

from __future__ import annotations

import torch

from stratad.store.tiers.rows import PinnedRows


class FileRows:
    def __init__(
        self, ram: PinnedRows, rows: int, slot_bytes: int, offsets: torch.Tensor,
        device: torch.device,
    ) -> None:  # fmt: skip
        """`rows`: the most experts one layer of a fused pass routes to (tokens x top-k), 0
        when the file holds no expert that a step could route to; `offsets` [L, 3]: each
        layer's (gate, up, down) offsets inside a blob, as the table holds them."""
        self.ram, self.device, self.offsets = ram, device, offsets
        pin = device.type == "cuda"  # mapped for the device: the kernels read it in place
        self.rows = torch.zeros((max(rows, 1), slot_bytes), dtype=torch.uint8, pin_memory=pin)
        self.enabled = rows > 0

    @property
    def address(self) -> int:
        """Where the table points experts that only the file holds until a step reads them."""
        return int(self.rows[0].data_ptr())

    def before(
        self, layer: int, ids: torch.Tensor, in_vram: dict[int, int], table: torch.Tensor
    ) -> None:
        """Read the layer's routed experts [T, k] that only the file holds; point `table`
        [L, E, 3] at them."""
        if not self.enabled:
            return
        ram = self.ram
        wanted = sorted(
            {x for x in ids.reshape(-1).tolist() if x >= 0 and x not in in_vram}
            - ram.row_of[layer].keys()
        )
        if not wanted:
            return
        if len(wanted) > self.rows.shape[0]:
            raise RuntimeError(f"{len(wanted)} file reads for {self.rows.shape[0]} bounce rows")
        for row, expert in enumerate(wanted):
            ram.file_read(layer, expert, self.rows[row])
        base = torch.tensor([int(self.rows[r].data_ptr()) for r in range(len(wanted))])
        addrs = base[:, None] + self.offsets[layer][None, :]  # [n, 3]
        table[layer, torch.tensor(wanted)] = addrs.to(self.device)
