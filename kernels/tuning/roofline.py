"""A kernel's time against the device's ceilings: what `stratactl bench kernels` reports.

The ceilings are measured here, on the device that runs the kernels: the copy rates
host→device (from page-locked memory) and device→device (read + write counted), the matmul
rate of a large torch product in bfloat16 and float16, and the launch floor (the time of the
smallest Triton kernel, timed as every kernel is). A kernel's ideal time is the largest of
its bytes over the matching copy rate, its FLOPs over the matmul rate, and the launch floor;
its share is that ideal over the time measured. A share near 1 is as fast as the device
allows; a share above 1 means the bytes came from a cache (L2), not from memory.

The cpu engine's kernels (`stratad.tuning.cpu_kernel_bench`, on a host without a GPU) are held
to the host's memory read rate instead of a copy rate (link "read"), the float32 GEMM rate,
and the floor of a call. `measure_ceilings` on the CPU (the Triton kernels in Triton's
interpreter) is for the tests of the GPU report: its timings say nothing about a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

FLAG_BELOW = 0.3  # the default share under which a kernel is flagged


@dataclass(frozen=True)
class Ceilings:
    h2d_gbs: float  # host→device from page-locked memory (the CPU: a memory copy)
    d2d_gbs: float  # device→device, read + write counted
    matmul_tflops: dict[str, float]  # by dtype name: "bfloat16", "float16" (CPU: "float32")
    launch_us: float  # the smallest Triton kernel, timed as the kernels are
    read_gbs: float = 0.0  # the host's memory read rate (the cpu engine's kernels' link)

    def gbs(self, link: str) -> float:
        """The bandwidth of `link`: "h2d", "d2d" or "read"."""
        return {"h2d": self.h2d_gbs, "d2d": self.d2d_gbs, "read": self.read_gbs}[link]

    def matmul(self, dtype: str) -> float:
        """The rate of `dtype`, else the best measured (a dtype not measured)."""
        return self.matmul_tflops.get(dtype) or max(self.matmul_tflops.values())


@dataclass(frozen=True)
class Row:
    """One kernel timed at one shape."""

    phase: str  # "decode" or "prefill"
    kernel: str
    shape: str
    us: float  # per call
    nbytes: int = 0  # that the kernel must move (read + write)
    flops: int = 0
    link: str = "d2d"  # the bandwidth ceiling its bytes cross: "d2d", "h2d" or "read"
    dtype: str = "bfloat16"  # the matmul rate its FLOPs are held to


@dataclass(frozen=True)
class Judged:
    row: Row
    rate: float  # achieved, in `unit`
    unit: str  # "GB/s" or "TFLOP/s"
    share: float  # ideal time / measured time
    bound: str  # which ceiling sets the ideal: the row's link, "matmul" or "launch"
    flagged: bool

    def to_json(self) -> dict[str, object]:
        return {**asdict(self.row), "rate": float(f"{self.rate:.4g}"), "unit": self.unit,
                "share": float(f"{self.share:.4g}"), "bound": self.bound,
                "flagged": self.flagged}  # fmt: skip


def judge(row: Row, ceilings: Ceilings, flag_below: float = FLAG_BELOW) -> Judged:
    """The row's achieved rate and its share of what the ceilings allow."""
    ideal = {  # microseconds each ceiling allows
        row.link: row.nbytes / ceilings.gbs(row.link) / 1e3,
        "matmul": row.flops / ceilings.matmul(row.dtype) / 1e6,
        "launch": ceilings.launch_us,
    }
    bound = max(ideal, key=lambda k: ideal[k])
    share = ideal[bound] / row.us if row.us > 0 else 0.0
    if row.flops and ideal["matmul"] >= ideal[row.link]:
        rate, unit = row.flops / row.us / 1e6, "TFLOP/s"
    else:
        rate, unit = row.nbytes / row.us / 1e3, "GB/s"
    return Judged(row, rate, unit, share, bound, share < flag_below)


def table(judged: list[Judged], flag_below: float) -> str:
    """The report as one table: a flagged kernel is marked and counted at the end."""
    lines = [f"{'phase':8} {'kernel':30} {'shape':26} {'us':>9} {'rate':>14} {'share':>6}"
             f" {'bound':>6}"]  # fmt: skip
    for j in judged:
        r = j.row
        mark = "  << slow" if j.flagged else ""
        lines.append(f"{r.phase:8} {r.kernel:30.30} {r.shape:26.26} {r.us:9.1f}"
                     f" {j.rate:8.3g} {j.unit:<7} {j.share:5.0%} {j.bound:>6}{mark}")  # fmt: skip
    return "\n".join(lines + summary(judged, flag_below))


def summary(judged: list[Judged], flag_below: float) -> list[str]:
    """A report's last lines: the kernels under `flag_below`, and the slowest against its
    ceiling."""
    slow = [j for j in judged if j.flagged]
    lines = [f"{len(slow)} of {len(judged)} kernels under {flag_below:.0%} of the ceiling"
             + (": " + ", ".join(f"{j.row.phase} {j.row.kernel}" for j in slow)
                if slow else "")]  # fmt: skip
    if judged:
        worst = min(judged, key=lambda j: j.share)
        lines.append(f"slowest: {worst.row.phase} {worst.row.kernel}, {worst.share:.0%} of its"
                     f" ceiling ({worst.bound})")  # fmt: skip
    return lines


# --- measuring ---------------------------------------------------------------------------


def time_us(
    run: Callable[[], object], device: torch.device, rep_ms: int = 20, graph: bool = True
) -> float:
    """Microseconds per call of `run`, which has run once already (compiled, warm). On a GPU
    the calls replay in a CUDA/HIP graph, as decode runs them (timed from Python, a launch's
    own cost would outweigh a small kernel); `graph=False` (a call that syncs with the host)
    launches them one by one. The median of a fixed budget of `rep_ms`. On the CPU one timed
    call."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing

    if graph:
        ms = triton.testing.do_bench_cudagraph(run, rep=rep_ms, return_mode="median")
    else:
        ms = triton.testing.do_bench(run, warmup=rep_ms // 4, rep=rep_ms, return_mode="median")
    return float(ms) * 1e3


@triton.jit
def _one_store(out_ptr):
    tl.store(out_ptr, 1.0)


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    """The copy rates, matmul rates and launch floor of `device` (a few seconds on a GPU)."""
    gpu = device.type == "cuda"
    copy_bytes = (256 if quick else 1024) << 20 if gpu else (16 if quick else 64) << 20
    d2d, h2d = copy_rates(copy_bytes, device)
    n = (4096 if quick else 8192) if gpu else (256 if quick else 512)
    dtypes = (torch.bfloat16, torch.float16) if gpu else (torch.float32,)
    rates = {str(d).removeprefix("torch."): matmul_tflops(n, d, device) for d in dtypes}
    out = torch.zeros(1, dtype=torch.float32, device=device)
    _one_store[(1,)](out)
    launch = time_us(lambda: _one_store[(1,)](out), device, rep_ms=10)
    return Ceilings(h2d, d2d, rates, launch)


def copy_rates(nbytes: int, device: torch.device) -> tuple[float, float]:
    """GB/s device→device (read + write) and host→device from page-locked memory (the CPU:
    half its copy rate, the one side a copy reads)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    d2d = 2 * nbytes / _wall_us(lambda: dst.copy_(src), device) / 1e3
    if device.type != "cuda":
        return d2d, d2d / 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(host, non_blocking=True)
    return d2d, nbytes / _wall_us(lambda: dst.copy_(host, non_blocking=True), device) / 1e3


def matmul_tflops(n: int, dtype: torch.dtype, device: torch.device) -> float:
    """TFLOP/s of an [n, n] product in `dtype` (the best of a few)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    return 2 * n**3 / _wall_us(lambda: torch.mm(a, b), device) / 1e6


def _wall_us(run: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """The best of `repeats` timed calls of a large operation (microseconds): its launch cost
    is nothing beside its length, and the best run is the device's rate."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e6)
    return min(times)
