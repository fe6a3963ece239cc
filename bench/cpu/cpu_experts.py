"""How fast the CPU expert kernels (kernels/cpu/experts.py) turn weight bytes into outputs,
against the host's read bandwidth.

    python -m bench.cpu.cpu_experts [--json PATH] [--threads N ...] [--types Q4_K Q6_K ...]

1. Read bandwidth, per thread count: torch's sum over >= 1 GiB of float32 (torch threads set
   to N) and the kernels' own read probe (64-bit word sum, OpenMP), before and after the
   experts; the best of them is the host's (other work on a shared machine only lowers it).
2. Per type (the same type for gate/up/down, plus a Q4_K_M mix): one MoE layer's CPU items
   at a3b's expert shapes (hidden 2048, ffn 768), 8 distinct experts per token, 1 and 4
   tokens, cycling through enough distinct experts (>= 64, >= 256 MiB) that none is in cache.
   The rate is weight bytes read per second; median and spread of 3 passes, and its share of
   the read bandwidth at the same thread count.
3. The torch path the engine has today (dequantize the expert to float32, then matvec), at
   one thread count, for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.cpu.experts import CpuExpertFormat, CpuExperts, physical_cores
from kernels.formats.quant import FLOAT_QTYPES, QUANTIZE_QTYPES, QType, block_geometry, dequantize
from kernels.formats.quant import quantize as quantize_blocks

HIDDEN, FFN, TOP_K = 2048, 768, 8
TYPES = ["Q4_0", "Q4_0s", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS",
         "IQ3_S", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "F16", "IQ3_XXS", "IQ2_XXS", "IQ2_XS",
         "IQ2_S", "IQ1_S"]  # fmt: skip
# the first fp16 scale's offset(s) of the types written as random blocks (no quantizer here)
_FP16_AT = {QType.IQ3_S: (0,), QType.IQ4_XS: (0,), QType.IQ4_NL: (0,), QType.Q2_K: (80, 82),
            QType.Q3_K: (108,), QType.IQ3_XXS: (0,), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,),
            QType.IQ2_S: (0,), QType.IQ1_S: (0,)}  # fmt: skip


def _timed(fn: Callable[[], object], repeats: int = 3) -> list[float]:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _rate(nbytes: float, times: list[float]) -> dict[str, float]:
    """GB/s: median and spread (slowest, fastest) of the passes."""
    rates = sorted(nbytes / t / 1e9 for t in times)
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1]}


def read_bandwidth(
    cpu: CpuExperts, threads: int, gib: float = 1.0
) -> tuple[dict[str, float], dict[str, float]]:
    """GB/s reading >= 1 GiB: torch's float32 sum (torch at `threads`), the kernels' probe."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_sum = _rate(data.numel() * 4, _timed(lambda: data.sum()))
    finally:
        torch.set_num_threads(before)
    return torch_sum, _rate(data.numel() * 4, _timed(lambda: cpu.read(data)))


def _matrix(qtype: QType, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Flat uint8 GGUF blocks of random values with sane scales (no subnormal floats)."""
    if qtype in QUANTIZE_QTYPES:
        values = torch.randn(rows, cols, generator=gen) / cols**0.5
        return quantize_blocks(values, qtype).reshape(-1)
    if qtype in FLOAT_QTYPES:
        dtype = {QType.F32: torch.float32, QType.F16: torch.float16}.get(qtype, torch.bfloat16)
        return torch.randn(rows * cols, generator=gen).to(dtype).view(torch.uint8)
    block, nbytes = block_geometry(qtype)
    raw = torch.randint(0, 256, (rows * cols // block, nbytes), generator=gen).to(torch.uint8)
    for at in _FP16_AT[qtype]:
        scale = (torch.rand(raw.shape[0], generator=gen) / (4 * cols**0.5) + 1e-3).half()
        raw[:, at : at + 2] = scale.view(torch.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def expert_format(name: str) -> CpuExpertFormat:
    if name == "Q4_K_M":
        qtypes = (QType.Q4_K, QType.Q4_K, QType.Q6_K)
    else:
        qtype: QType = getattr(QType, name.removesuffix("s"))
        qtypes = (qtype, qtype, qtype)
    return CpuExpertFormat.packed(qtypes, HIDDEN, FFN, q4_0_split=name.endswith("s"))


def expert_blobs(fmt: CpuExpertFormat, min_bytes: int = 256 << 20) -> list[torch.Tensor]:
    """>= 64 distinct experts (copies of one random expert in separate memory), >= min_bytes."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
    parts = [_matrix(q, r, c, gen) for q, (r, c) in zip(fmt.qtypes, shapes, strict=True)]
    if fmt.q4_0_split:
        from kernels.experts.moe import split_q4_0

        parts = [split_q4_0(p.reshape(r, -1)) if q == QType.Q4_0 else p
                 for p, q, (r, _) in zip(parts, fmt.qtypes, shapes, strict=True)]  # fmt: skip
    blob = torch.cat(parts)
    count = max(64, -(-min_bytes // blob.numel()))
    count = -(-count // (4 * TOP_K)) * 4 * TOP_K  # whole 4-token layers
    store = blob.repeat(count).reshape(count, -1)
    return list(store)


def expert_rate(cpu: CpuExperts, fmt: CpuExpertFormat, blobs: list[torch.Tensor],
                tokens: int) -> dict[str, float]:  # fmt: skip
    """GB/s of weight bytes: layers of `tokens` x TOP_K distinct experts, over every blob."""
    per_call = tokens * TOP_K
    x = torch.randn(tokens, HIDDEN)
    out = torch.zeros(tokens, HIDDEN)
    token_ids = [t for t in range(tokens) for _ in range(TOP_K)]
    weights = [0.125] * per_call

    if per_call > len(blobs):
        raise ValueError(f"{tokens} tokens need {per_call} distinct experts, {len(blobs)} made")
    starts = range(0, len(blobs) - per_call + 1, per_call)  # whole calls only

    def sweep() -> None:
        for start in starts:
            cpu.moe(x, blobs[start : start + per_call], token_ids, weights, fmt, out)

    return _rate(len(starts) * per_call * fmt.nbytes, _timed(sweep))


def torch_rate(fmt: CpuExpertFormat, blobs: list[torch.Tensor], n: int = 8) -> dict[str, float]:
    """The engine's path today: dequantize each expert to float32, then matvec (1 token)."""
    x = torch.randn(HIDDEN)
    shapes = ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
    offsets = (0, fmt.up_offset, fmt.down_offset, fmt.nbytes)

    def sweep() -> None:
        for blob in blobs[:n]:
            g, u, d = (
                dequantize(blob[offsets[k] : offsets[k + 1]], q, s)
                for k, (q, s) in enumerate(zip(fmt.qtypes, shapes, strict=True))
            )
            d @ (torch.nn.functional.silu(g @ x) * (u @ x))

    return _rate(n * fmt.nbytes, _timed(sweep))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts (default 1..cores)")
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    cores = physical_cores()
    threads = args.threads or sorted({1, *[2**k for k in range(1, 8) if 2**k < cores], cores})
    kernels = {n: CpuExperts(threads=n) for n in threads}
    reads: list[dict[str, object]] = []
    rows: list[dict[str, object]] = []
    results: list[tuple[str, int, int, dict[str, float]]] = []

    def measure_reads(when: str) -> None:
        for n in threads:
            torch_sum, probe = read_bandwidth(kernels[n], n)
            reads.append({"when": when, "threads": n, "torch_sum": torch_sum,
                          "kernel_read": probe})  # fmt: skip
            print(f"read bandwidth ({when}), {n} threads: torch sum {torch_sum['median']:.1f} "
                  f"GB/s, kernel probe {probe['median']:.1f} GB/s")  # fmt: skip

    # before and after the experts: on a shared machine the better of the two is the host's
    measure_reads("before")
    for name in args.types:
        fmt = expert_format(name)
        blobs = expert_blobs(fmt)
        for tokens in args.tokens:
            for n in threads:
                results.append((name, tokens, n, expert_rate(kernels[n], fmt, blobs, tokens)))
        del blobs
    measure_reads("after")
    bandwidth = {
        n: max(max(r["torch_sum"]["median"], r["kernel_read"]["median"])  # type: ignore[index]
               for r in reads if r["threads"] == n)
        for n in threads
    }  # fmt: skip
    print(f"{'type':8} {'tok':>3} {'thr':>3} {'GB/s':>6} {'spread':>13} {'of read':>7}")
    for name, tokens, n, rate in results:
        share = rate["median"] / bandwidth[n]
        rows.append({"type": name, "tokens": tokens, "threads": n, "gbps": rate,
                     "share_of_read": share})  # fmt: skip
        print(f"{name:8} {tokens:>3} {n:>3} {rate['median']:6.1f} "
              f"{rate['min']:5.1f}-{rate['max']:5.1f}  {share:6.0%}")  # fmt: skip
    q4_k = expert_format("Q4_K")
    base = torch_rate(q4_k, expert_blobs(q4_k, 0))
    print(f"torch dequantize + matvec (today's path), Q4_K, 1 token: {base['median']:.2f} GB/s")
    report: dict[str, object] = {"cores": cores, "threads": threads, "read": reads,
              "read_gbps": bandwidth,
              "experts": rows, "torch_dequantize_q4_k": base}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
