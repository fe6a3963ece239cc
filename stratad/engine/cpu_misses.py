"""The CPU miss path: part of a decode step's missed experts computed on the CPU from the
page-locked RAM copy while the GPU's fused kernel reads the rest in place over PCIe.

Which misses go to the CPU is `engine.pcie_frac` (the GPU's share), taken deterministically:
the last (1 - pcie_frac) of the misses in slot order. The host must see the routing, so a
step with a CPU share synchronises once per layer and is not captured as a graph.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from stratad.engine.layers import swiglu

if TYPE_CHECKING:
    from stratad.engine.offload import OffloadForward


class CpuMisses:
    def __init__(self, engine: OffloadForward) -> None:
        self.engine = engine
        self.experts = 0  # expert computations done on the CPU so far
        # a blob only the file holds is read into this, on the host
        self._scratch = torch.empty(engine.layout.nbytes, dtype=torch.uint8)

    def slots(self, layer: int, ids: list[list[int]]) -> list[tuple[int, int]]:
        """The (token, slot) pairs whose missed expert the CPU computes."""
        resident = self.engine.slot_of[layer]
        misses = [(t, k) for t, row in enumerate(ids) for k, e in enumerate(row)
                  if e not in resident]  # fmt: skip
        n_cpu = round(len(misses) * (1.0 - self.engine.config.pcie_frac))
        return misses[len(misses) - n_cpu :] if n_cpu else []

    def run(
        self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The layer's routed-expert outputs [T, P, H] float32 (the engine sums them): hits
        and the GPU's share of misses in the fused kernel, the CPU's share computed meanwhile
        (one more part)."""
        e = self.engine
        stage = e.timer.stage
        host_ids = ids.tolist()  # one synchronisation per layer: h and the weights are ready
        cpu = self.slots(layer, host_ids)
        x, w = h.float().cpu(), weights.cpu()  # before queueing the kernel, not after it
        gpu_ids = ids.clone()
        if cpu:
            t_idx, k_idx = zip(*cpu, strict=True)
            gpu_ids[list(t_idx), list(k_idx)] = -1  # the kernel skips these slots
        parts = e.gpu_experts(layer, h, gpu_ids, weights)  # queued; runs while the CPU works
        if not cpu:
            return parts
        with stage("experts (CPU)"):
            out = torch.zeros((h.shape[0], e.spec.hidden), dtype=torch.float32)
            for t, k in cpu:
                out[t] += w[t, k] * swiglu(x[t], *self.expert(layer, host_ids[t][k]))
        self.experts += len(cpu)
        return torch.cat([parts, out.to(parts.device)[:, None]], dim=1)

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One expert's float32 (gate, up, down) from the RAM copy (dequantized per use)."""
        e = self.engine
        g, u, d = e.layout.views(e.host.read(layer, expert, self._scratch))
        return g.dequantize(), u.dequantize(), d.dequantize()

    def measure_bps(self, repeats: int = 3) -> float:
        """Expert bytes per second the CPU turns into outputs (dequantize + matvec)."""
        spec = self.engine.spec
        x = torch.randn(spec.hidden)
        times = []
        for r in range(repeats + 1):  # the first one warms up
            t0 = time.perf_counter()
            swiglu(x, *self.expert(0, r % spec.n_experts))
            times.append(time.perf_counter() - t0)
        return self.engine.layout.nbytes / sorted(times[1:])[len(times[1:]) // 2]
