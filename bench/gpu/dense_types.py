"""Decode's dense projections in bf16 (as the offload engine holds them) against the same
matrices read in their GGUF type (`kernels.layers.qlinear`), at a model's shapes.

    python -m bench.gpu.dense_types [--tokens 1,8] [--types q4_k q6_k q8_0]
                                    [--configs 4:1:1 2:4:1 ...] [--kernel-table TABLE]
                                    [--json PATH]

The shapes are the a3b's (Qwen3-30B-A3B): qkv [5120, 2048], o [2048, 4096] and the output
head [151936, 2048]. Each matrix is held in enough copies to outgrow the L2 cache three times
over and the copies are read in turn, in a CUDA graph, as decode reads each layer's weights
once per step from HBM. Prints µs per matrix (median of --repeats, the spread), the bytes read
per second and the time against bf16's. bf16 runs `decode_linear` with the table's `linear`
setting (`--kernel-table`, default the shipped table for this stack), and beside it torch's
`linear` (the GEMM library, what a step of more than `linear.max_tokens` rows runs); each
`--configs` setting (`block_n:super_blocks:num_warps`) runs `qlinear` for each type. The
device's copy rate (D2D) is the ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels.formats.quant import QType, row_bytes
from kernels.layers.linear import LinearConfig, decode_linear
from kernels.layers.qlinear import QLinearConfig, qlinear
from kernels.tuning.configs import load_configs
from kernels.tuning.roofline import copy_rates
from stratad.tuning.bench_weights import random_blocks

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "head": (151936, 2048)}
L2_BYTES = 50 << 20
TABLE = Path(__file__).parents[2] / "kernels" / "tables" / "sm90-cuda-13.0.json"


def _config(text: str) -> QLinearConfig:
    n, sb, w = (int(v) for v in text.split(":"))
    return QLinearConfig(block_n=n, super_blocks=sb, num_warps=w)


def _timed(run: Callable[[], object], calls: int, repeats: int) -> tuple[float, list[float]]:
    """µs per call: the calls captured in a graph, replayed `repeats` times."""
    for _ in range(2):
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), [min(times), max(times)]


def _copies(nbytes: int) -> int:
    """Copies of a matrix that outgrow the L2 cache three times over."""
    return max(1, -(-3 * L2_BYTES // nbytes))


def time_bf16(x: torch.Tensor, n: int, linear: LinearConfig, repeats: int) -> dict[str, Any]:
    k = x.shape[1]
    copies = _copies(n * k * 2)
    ws = [torch.randn(n, k, device=x.device, dtype=torch.bfloat16) for _ in range(copies)]
    us, spread = _timed(lambda: [decode_linear(x, w, None, linear) for w in ws], len(ws), repeats)
    torch_us, torch_spread = _timed(lambda: [torch.nn.functional.linear(x, w) for w in ws],
                                    len(ws), repeats)  # fmt: skip
    return {"us": us, "spread": spread, "gbs": n * k * 2 / us / 1e3, "torch_us": torch_us,
            "torch_spread": torch_spread, "torch_gbs": n * k * 2 / torch_us / 1e3}  # fmt: skip


def time_quantized(
    x: torch.Tensor, n: int, qtype: QType, configs: list[QLinearConfig], repeats: int
) -> dict[str, dict[str, Any]]:
    k = x.shape[1]
    nbytes = n * row_bytes(qtype, k)
    qs = [random_blocks(qtype, n, k, x.device).reshape(n, -1) for _ in range(_copies(nbytes))]
    out = {}
    for cfg in configs:

        def run(cfg: QLinearConfig = cfg) -> None:
            for q in qs:
                qlinear(x, q, qtype, cfg)

        us, spread = _timed(run, len(qs), repeats)
        tag = f"{cfg.block_n}:{cfg.super_blocks}:{cfg.num_warps}"
        out[tag] = {"us": us, "spread": spread, "gbs": nbytes / us / 1e3}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8])
    p.add_argument("--types", nargs="*", default=["q4_k", "q6_k", "q8_0"],
                   help="GGUF types to read the matrices in (none: bf16 and torch alone)")
    p.add_argument("--configs", nargs="+", type=_config,
                   default=[QLinearConfig(), QLinearConfig(block_n=2, super_blocks=4)])  # fmt: skip
    p.add_argument("--kernel-table", type=Path, default=TABLE)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    linear = load_configs(a.kernel_table).linear
    d2d = copy_rates(1 << 30, torch.device("cuda"))[0]
    print(f"{torch.cuda.get_device_name()}: D2D {d2d:.0f} GB/s; bf16 with {linear}")
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "d2d_gbs": d2d}
    for name, (n, k) in SHAPES.items():
        for t in a.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            base = out[f"{name}/t{t}/bf16"] = time_bf16(x, n, linear, a.repeats)
            print(f"{name:5} [{n}, {k}] T={t}: bf16 {base['us']:8.1f} us ({base['gbs']:.0f} GB/s);"
                  f" torch {base['torch_us']:8.1f} us ({base['torch_gbs']:.0f} GB/s)")
            for type_name in a.types:
                qtype = QType.__members__[type_name.upper()]
                for tag, r in time_quantized(x, n, qtype, a.configs, a.repeats).items():
                    r["x_bf16"] = r["us"] / base["us"]
                    out[f"{name}/t{t}/{type_name}/{tag}"] = r
                    print(f"      {type_name:5} {tag:7} {r['us']:8.1f} us ({r['gbs']:.0f} GB/s,"
                          f" {100 * r['gbs'] / d2d:.1f}% of D2D) {r['x_bf16']:.2f}x bf16")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
