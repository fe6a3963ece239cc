"""The CPU miss path: part of a decode step's missed experts computed on the CPU from the
page-locked RAM copy while the GPU's fused kernel reads the rest over PCIe.

Which misses go to the CPU is `engine.pcie_frac` (the GPU's share), taken deterministically:
the last (1 - pcie_frac) of the misses in slot order. The host must see the routing, so a
step with a CPU share waits for each layer's routing (`split_step` captures the GPU's work
between those waits in pieces).

How the CPU computes them is an `ExpertMath`: the compiled kernels (`kernels.cpu.experts`:
integer dots on the blobs' own bytes, every core, the GIL let go while the GPU works), or,
where no C compiler is found, torch dequantizing each expert per use (a few hundred MB/s;
said once at start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kernels.cpu.build import CpuKernelsUnavailable
from kernels.cpu.experts import PLAIN, CpuExpertFormat, CpuExperts, ExpertExtras
from stratad.engine.expert_ffn import PLAIN_FFN, ExpertFfn
from stratad.engine.offload.experts import BlobLayout, ExpertLayouts
from stratad.engine.timing import StageTimer
from stratad.model.graph.activation import SILU, ClampedSwiGlu
from stratad.store.tiers.address_table import AddressTable

log = logging.getLogger(__name__)

GpuExperts = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertMath(Protocol):
    name: str

    def moe(self, x: torch.Tensor, blobs: Sequence[torch.Tensor], tokens: Sequence[int],
            weights: Sequence[float], layout: BlobLayout, out: torch.Tensor,
            extras: ExpertExtras = PLAIN) -> None:  # fmt: skip
        """out[tokens[i]] += weights[i] * expert_i(x[tokens[i]]), float32 on the CPU; `extras`:
        the items' biases and clamped SwiGLU."""


class CompiledMath:
    """The C kernels, reading Q4_0 split, Q6_K split or as blocks, and every other type as
    GGUF blocks; a layer holding a type they do not read (outside `CpuExperts.supported`: no
    quantized type today) is dequantized in torch per use, as `TorchMath` does."""

    def __init__(self, kernels: CpuExperts) -> None:
        self.kernels = kernels
        self.name = f"compiled kernels, {kernels.threads} threads"
        self._formats: dict[BlobLayout, CpuExpertFormat] = {}

    def moe(self, x: torch.Tensor, blobs: Sequence[torch.Tensor], tokens: Sequence[int],
            weights: Sequence[float], layout: BlobLayout, out: torch.Tensor,
            extras: ExpertExtras = PLAIN) -> None:  # fmt: skip
        if not set(layout.qtypes) <= self.kernels.supported:
            TorchMath().moe(x, blobs, tokens, weights, layout, out, extras)
            return
        fmt = self._formats.get(layout)
        if fmt is None:
            fmt = self._formats[layout] = CpuExpertFormat(
                layout.qtypes, layout.hidden, layout.ffn, layout.up_offset, layout.down_offset,
                layout.split, layout.q6_k_split, mxfp4_split=layout.split)  # fmt: skip
        self.kernels.moe(x, blobs, tokens, weights, fmt, out, extras)


class TorchMath:
    """Each expert dequantized to float32 per use (the reference; no compiler needed)."""

    name = "torch, dequantized per use"

    def moe(self, x: torch.Tensor, blobs: Sequence[torch.Tensor], tokens: Sequence[int],
            weights: Sequence[float], layout: BlobLayout, out: torch.Tensor,
            extras: ExpertExtras = PLAIN) -> None:  # fmt: skip
        act = SILU if extras.clamp is None else ClampedSwiGlu(*extras.clamp)
        for i, (blob, t, w) in enumerate(zip(blobs, tokens, weights, strict=True)):
            g, u, d = (m.dequantize() for m in layout.views(blob))
            gate, up = g @ x[t], u @ x[t]
            if extras.gate_up_bias is not None:
                gate, up = gate + extras.gate_up_bias[i, 0], up + extras.gate_up_bias[i, 1]
            y = d @ act(gate, up)
            out[t] += w * (y if extras.down_bias is None else y + extras.down_bias[i])


def expert_math(compiled: bool, threads: int | None = None) -> ExpertMath:
    """The compiled kernels when asked for and a compiler builds them, else torch (said)."""
    if not compiled:
        return TorchMath()
    try:
        return CompiledMath(CpuExperts(threads))
    except CpuKernelsUnavailable as err:
        log.warning("CPU experts: %s; missed experts computed on the CPU are dequantized in"
                    " torch per use (slow: keep engine.pcie_frac at 1 or auto)", err)
        return TorchMath()


def balanced_frac(cpu_bps: float, gpu_bps: float) -> float:
    """The GPU's share of the misses that lets the link and the CPU finish together; 1 when
    the CPU's share would be under 10% (not worth a synchronisation per layer)."""
    share = cpu_bps / (cpu_bps + gpu_bps)
    return 1.0 if share < 0.1 else round(1.0 - share, 2)


class CpuMisses:
    def __init__(
        self, experts: AddressTable, layouts: ExpertLayouts, hidden: int, math: ExpertMath,
        ffn: ExpertFfn = PLAIN_FFN,
    ) -> None:  # fmt: skip
        self.table, self.layouts, self.hidden, self.math = experts, layouts, hidden, math
        self.ffn = ffn
        self.experts = 0  # expert computations done on the CPU so far
        # blobs only the file holds are read into these, on the host (one per CPU slot)
        self._scratch: list[torch.Tensor] = []

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
            self.compute(layer, host_ids, x, w.tolist(), cpu, out)
        return torch.cat([parts, out.to(parts.device)[:, None]], dim=1)

    def compute(
        self,
        layer: int,
        host_ids: list[list[int]],
        x: torch.Tensor,
        weights: list[list[float]],
        slots: list[tuple[int, int]],
        out: torch.Tensor,
    ) -> None:
        """out[t] += weights[t][k] * expert(x[t]) for each (token t, slot k) of `slots`, on
        the CPU (x and out [T, H] float32 on the host)."""
        experts = [host_ids[t][k] for t, k in slots]
        blobs = [self._blob(layer, e, n) for n, e in enumerate(experts)]
        self.math.moe(x, blobs, [t for t, _ in slots], [weights[t][k] for t, k in slots],
                      self.layouts[layer], out, self.ffn.extras(layer, experts))  # fmt: skip
        self.experts += len(slots)

    def _blob(self, layer: int, expert: int, i: int) -> torch.Tensor:
        """The expert's RAM copy, or its bytes read from the file into scratch row i."""
        host = self.table.ram
        if host.has(layer, expert):
            return host.blob(layer, expert)
        while len(self._scratch) <= i:
            self._scratch.append(torch.empty(self.table.slot_bytes, dtype=torch.uint8))
        return host.file_read(layer, expert, self._scratch[i])

    def measure_bps(self, repeats: int = 3, per_call: int = 4) -> float:
        """Expert bytes per second the CPU turns into outputs, `per_call` distinct experts of
        one layer a call (a step's CPU share), each repeat on another layer's experts."""
        t = self.table
        layers = list(t.layers)
        n_experts = t.table.shape[1]
        x = torch.randn(1, self.hidden)
        times, nbytes = [], 0
        for r in range(repeats + 1):  # the first one warms up
            layer = layers[(r * 7) % len(layers)]
            experts = [(r * per_call + j) % n_experts for j in range(per_call)]
            blobs = [self._blob(layer, e, j) for j, e in enumerate(experts)]
            out = torch.zeros(1, self.hidden)
            t0 = time.perf_counter()
            self.math.moe(x, blobs, [0] * per_call, [1.0] * per_call, self.layouts[layer], out)
            times.append(time.perf_counter() - t0)
            nbytes = per_call * self.layouts[layer].nbytes
        return nbytes / sorted(times[1:])[len(times[1:]) // 2]
