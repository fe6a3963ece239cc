"""Dense weight products on the CPU: GGUF rows as they are against rows interleaved in eights
(`kernels/cpu/interleave.h`), at a small dense model's shapes.

    python -m bench.cpu.dense_rows [--threads N] [--tokens 1 4 16] [--json PATH]

Per type and shape: microseconds per product and weight bytes read per second, the best of 3
timings per round, median and spread of 3 rounds, the two layouts alternating within each
round. Enough copies of each weight are cycled (>= 48 MiB) that none stays in the caches,
except the [49152, 576] head, which is one matrix of 30 MiB read once per product (a decode
step's head). The ceiling is the host's read rate, measured here with the kernels' own probe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.cpu.cpu_experts import read_bandwidth
from kernels.cpu.experts import CpuExperts, PreparedMatmul, physical_cores
from kernels.formats.quant import QType, quantize

# SmolLM2-135M's projections: gate/up, down, q/o, k/v; its tied Q8_0 head; a 1B llama's
# gate/up in Q4_K and down in Q6_K (Q4_K_M's mix)
SHAPES = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q4_1", 576, 576), ("Q4_1", 192, 576),
          ("Q4_0", 1536, 576), ("Q8_0", 1536, 576), ("Q8_0", 49152, 576),
          ("Q4_K", 8192, 2048), ("Q6_K", 2048, 8192)]  # fmt: skip
CYCLE_BYTES = 48 << 20


def _time(products: list[PreparedMatmul], x: torch.Tensor, reps: int) -> float:
    """Seconds per product: the best of 3 timings of `reps` passes over the copies."""
    for p in products:
        p(x)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            for p in products:
                p(x)
        best = min(best, (time.perf_counter() - t0) / reps / len(products))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=physical_cores())
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    layouts = {"gguf": CpuExperts(args.threads, interleave=False),
               "interleaved": CpuExperts(args.threads)}  # fmt: skip
    if not layouts["interleaved"].interleaves:
        raise SystemExit("this build has no interleaved dots (no AVX2/F16C): nothing to compare")
    _, probe = read_bandwidth(layouts["gguf"], args.threads)  # bench.cpu.cpu_experts's
    ceiling = probe["max"]
    print(f"{args.threads} threads; host read rate {ceiling:.1f} GB/s (the kernels' probe)")
    print("| type | rows x cols | tokens | GGUF rows us (GB/s) | interleaved us (GB/s) | x |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for name, rows, cols in SHAPES:
        qtype = QType[name]
        one = quantize(torch.randn(rows, cols, generator=gen) * 0.02, qtype).contiguous()
        copies = max(1, CYCLE_BYTES // one.numel())
        weights = [one] + [one.clone() for _ in range(copies - 1)]
        for t in args.tokens:
            x = torch.randn(t, cols, generator=gen)
            prepared = {k: [ce.prepare(w, qtype, rows, cols) for w in weights]
                        for k, ce in layouts.items()}  # fmt: skip
            reps = max(1, int(2e8 // (one.numel() * copies)))
            runs: dict[str, list[float]] = {k: [] for k in layouts}
            for _ in range(3):
                for k, products in prepared.items():
                    runs[k].append(_time(products, x, reps))
            med = {k: statistics.median(v) for k, v in runs.items()}
            gbs = {k: one.numel() / v / 1e9 for k, v in med.items()}
            cells = " | ".join(f"{med[k] * 1e6:.1f} ({gbs[k]:.1f})" for k in layouts)
            speedup = med["gguf"] / med["interleaved"]
            print(f"| {name} | {rows} x {cols} | {t} | {cells} | {speedup:.2f} |")
            times = {f"{k}_us": [s * 1e6 for s in v] for k, v in runs.items()}
            rows_out.append({"type": name, "rows": rows, "cols": cols, "tokens": t, **times})
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "read_gbs": ceiling,
                                         "products": rows_out}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
