"""The CPU miss path: part of a decode step's missed experts computed on the CPU from the
page-locked RAM copy while the GPU's fused kernel reads the rest in place over PCIe.

Which misses go to the CPU is `engine.pcie_frac` (the GPU's share), taken deterministically:
the last (1 - pcie_frac) of the misses in slot order. The host must see the routing, so a
step with a CPU share synchronises once per layer and is not captured as a graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from stratad.engine.expert_table import ExpertTable
from stratad.engine.layers import swiglu
from stratad.engine.timing import StageTimer

GpuExperts = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CpuMisses:
    def __init__(self, experts: ExpertTable, hidden: int) -> None:
        self.table, self.hidden = experts, hidden
        self.experts = 0  # expert computations done on the CPU so far
        # a blob only the file holds is read into this, on the host
        self._scratch = torch.empty(experts.layouts.slot_bytes, dtype=torch.uint8)

    def slots(self, layer: int, ids: list[list[int]], pcie_frac: float) -> list[tuple[int, int]]:
        """The (token, slot) pairs whose missed expert the CPU computes: the last
        (1 - pcie_frac) of the misses in slot order."""
        resident = self.table.slot_of[layer]
        misses = [(t, k) for t, row in enumerate(ids) for k, e in enumerate(row)
                  if e not in resident]  # fmt: skip
        n_cpu = round(len(misses) * (1.0 - pcie_frac))
        return misses[len(misses) - n_cpu :] if n_cpu else []

    def run(
        self,
        layer: int,
        h: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        pcie_frac: float,
        gpu_experts: GpuExperts,
        timer: StageTimer,
    ) -> torch.Tensor:
        """The layer's routed-expert outputs [T, P, H] float32 (the engine sums them): hits
        and the GPU's share of misses by `gpu_experts` (the fused kernels), the CPU's share
        computed meanwhile (one more part)."""
        host_ids = ids.tolist()  # one synchronisation per layer: h and the weights are ready
        cpu = self.slots(layer, host_ids, pcie_frac)
        x, w = h.float().cpu(), weights.cpu()  # before queueing the kernel, not after it
        gpu_ids = ids.clone()
        if cpu:
            t_idx, k_idx = zip(*cpu, strict=True)
            gpu_ids[list(t_idx), list(k_idx)] = -1  # the kernel skips these slots
        parts = gpu_experts(layer, h, gpu_ids, weights)  # queued; runs while the CPU works
        if not cpu:
            return parts
        with timer.stage("experts (CPU)"):
            out = torch.zeros((h.shape[0], self.hidden), dtype=torch.float32)
            for t, k in cpu:
                out[t] += w[t, k] * swiglu(x[t], *self.expert(layer, host_ids[t][k]))
        self.experts += len(cpu)
        return torch.cat([parts, out.to(parts.device)[:, None]], dim=1)

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One expert's float32 (gate, up, down) from the RAM copy (dequantized per use)."""
        t = self.table
        g, u, d = t.layouts[layer].views(t.host.read(layer, expert, self._scratch))
        return g.dequantize(), u.dequantize(), d.dequantize()

    def measure_bps(self, repeats: int = 3) -> float:
        """Expert bytes per second the CPU turns into outputs (dequantize + matvec)."""
        x = torch.randn(self.hidden)
        n_experts = self.table.table.shape[1]
        times = []
        for r in range(repeats + 1):  # the first one warms up
            t0 = time.perf_counter()
            swiglu(x, *self.expert(self.table.layers.start, r % n_experts))
            times.append(time.perf_counter() - t0)
        layout = self.table.layouts[self.table.layers.start]
        return layout.nbytes / sorted(times[1:])[len(times[1:]) // 2]
