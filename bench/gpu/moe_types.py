"""The fused MoE decode kernels per GGUF type, at a model's shapes, against HBM's rate.

    python -m bench.gpu.moe_types [--hidden 2048 --ffn 768 --experts 128 --top-k 8]
                                  [--formats iq2_xxs iq1_s ...] [--tokens 1,8,32]
                                  [--configs 16:1:4 8:8:4 16:1:4:i8 ...] [--aligned-only]

For each expert format (Q4_0 split and each type the kernels read as GGUF blocks, Q4_K both
as blocks and as aligned words; `q4_k_m(q6_k split down)` holds its Q6_K down in
`kernels.experts.moe.split_q6_k`'s layout, which the int8 dots alone read) it builds
`--experts` random experts in VRAM and times `fused_moe` for T decode tokens (each routed
to a random top-k, CUDA graph, median of --repeats with the spread): microseconds per call
and the weight bytes read per second (the distinct routed experts' three projections: the
kernels read each once for all its tokens).
`--configs` times each launch setting `block_n:super_blocks:num_warps`, with `:i8` after it
for the int8 dots of Q4_K, Q5_K, Q6_K and Q8_0, `:ng` for a program per (token, expert)
pair rather than one per expert and `:bN` for N blocks per step of the Q4_0 and MXFP4
readers (default: the built-in `MoeConfig`). gpt-oss-20b's shapes: `--hidden 2880 --ffn 2880
--experts 32 --top-k 4 --formats mxfp4`. `--launch gate_up` or
`down` times that launch alone (the engine's table sets each apart: `kernels.moe` and
`kernels.moe_down`); `bench.gpu.moe_pick` writes the fastest of each into a tuning table.
The device's copy rate (D2D, `torch` copy of 1 GiB) is printed beside it as the ceiling.
`stratactl bench kernels` times the same kernels (each type the model holds) among all the
others, against ceilings it measures; this driver compares every type at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from kernels.experts.moe import (
    ExpertFormat,
    MoeConfig,
    expert_table,
    fused_moe,
    moe_down,
    moe_gate_up,
    split_mxfp4,
    split_q4_0,
    split_q6_k,
)
from kernels.formats.quant import QType
from kernels.tuning.roofline import copy_rates
from stratad.tuning.bench_weights import random_blocks

FORMATS: dict[str, tuple[QType, QType, QType]] = {
    "q4_0": (QType.Q4_0, QType.Q4_0, QType.Q4_0),
    "q4_k": (QType.Q4_K, QType.Q4_K, QType.Q4_K),
    "q4_k_m(q6_k down)": (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    "q4_k_m(q6_k split down)": (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    "q8_0": (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    "q5_k": (QType.Q5_K, QType.Q5_K, QType.Q5_K),
    "iq3_s(iq4_xs down)": (QType.IQ3_S, QType.IQ3_S, QType.IQ4_XS),
    "iq4_xs": (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_XS),
    "q3_k(q4_k down)": (QType.Q3_K, QType.Q3_K, QType.Q4_K),
    "q2_k": (QType.Q2_K, QType.Q2_K, QType.Q2_K),
    "iq3_xxs(q3_k down)": (QType.IQ3_XXS, QType.IQ3_XXS, QType.Q3_K),
    "iq2_xxs": (QType.IQ2_XXS, QType.IQ2_XXS, QType.IQ2_XXS),
    "iq2_xs": (QType.IQ2_XS, QType.IQ2_XS, QType.IQ2_XS),
    "iq2_s": (QType.IQ2_S, QType.IQ2_S, QType.IQ2_S),
    "iq1_s": (QType.IQ1_S, QType.IQ1_S, QType.IQ1_S),
    # gpt-oss's experts, in the split layout the engine holds them in (`split_mxfp4`)
    "mxfp4": (QType.MXFP4, QType.MXFP4, QType.MXFP4),
}


# the formats whose Q6_K projections are held in the split layout (`split_q6_k`)
Q6_K_SPLIT = frozenset({"q4_k_m(q6_k split down)"})


def _matrix(qtype: QType, rows: int, cols: int, q6_k_split: bool) -> torch.Tensor:
    """Random blocks with finite scales (`stratad.tuning.bench_weights`), Q4_0 and MXFP4 split
    (and Q6_K with q6_k_split), as the engine holds them."""
    data = random_blocks(qtype, rows, cols, torch.device("cuda"))
    if qtype == QType.Q4_0:
        return split_q4_0(data)
    if qtype == QType.MXFP4:
        return split_mxfp4(data)
    return split_q6_k(data) if qtype == QType.Q6_K and q6_k_split else data.reshape(-1)


def _config(text: str) -> MoeConfig:
    """`block_n:super_blocks:num_warps`, then any of `:i8` (the int8 dots), `:ng` (a program
    per pair, not grouped by expert) and `:bN` (N 32-value blocks per reduction step of the
    Q4_0 and MXFP4 readers, `block_b`)."""
    fields = text.split(":")
    n, sbs, w = (int(v) for v in fields[:3])
    flags = set(fields[3:])
    blocks = [f for f in flags if f[:1] == "b" and f[1:].isdigit()]
    if flags - {"i8", "ng", *blocks} or len(blocks) > 1:
        raise argparse.ArgumentTypeError(f"unknown flags in {text!r}: i8, ng and one bN are"
                                         " known")  # fmt: skip
    block_b = int(blocks[0][1:]) if blocks else MoeConfig.block_b
    return MoeConfig(block_n=n, super_blocks=sbs, num_warps=w, int8_dots="i8" in flags,
                     group_pairs="ng" not in flags, block_b=block_b)  # fmt: skip


def config_tag(cfg: MoeConfig) -> str:
    """The `--configs` text of a setting."""
    tag = f"{cfg.block_n}:{cfg.super_blocks}:{cfg.num_warps}"
    tag += (":i8" if cfg.int8_dots else "") + ("" if cfg.group_pairs else ":ng")
    return tag + ("" if cfg.block_b == MoeConfig.block_b else f":b{cfg.block_b}")


def _route(t: int, a: argparse.Namespace) -> torch.Tensor:
    return torch.stack([torch.randperm(a.experts, device="cuda")[: a.top_k]
                        for _ in range(t)]).to(torch.int32)  # fmt: skip


def time_format(
    mix: tuple[QType, QType, QType], aligned: bool, a: argparse.Namespace, t: int,
    cfg: MoeConfig, q6_k_split: bool = False,
) -> dict:  # fmt: skip
    h, f = a.hidden, a.ffn
    experts = [(_matrix(mix[0], f, h, q6_k_split), _matrix(mix[1], f, h, q6_k_split),
                _matrix(mix[2], h, f, q6_k_split)) for _ in range(a.experts)]  # fmt: skip
    table = expert_table(experts).cuda()  # type: ignore[arg-type]
    read = {"gate_up": experts[0][:2], "down": experts[0][2:]}.get(a.launch, experts[0])
    nbytes = sum(m.numel() for m in read)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    weights = torch.full((t, a.top_k), 1.0 / a.top_k, device="cuda")
    ids = _route(t, a)
    fmt = ExpertFormat(*mix, q6_k_split=q6_k_split)
    act = moe_gate_up(x, ids, table, f, cfg, aligned, fmt)

    def call() -> None:
        if a.launch == "gate_up":
            moe_gate_up(x, ids, table, f, cfg, aligned, fmt)
        elif a.launch == "down":
            moe_down(act, ids, weights, table, h, cfg, aligned, fmt)
        else:
            fused_moe(x, ids, weights, table, f, cfg, aligned, fmt)

    for _ in range(3):  # compile, warm
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(a.calls):
            call()
    times, distinct = [], []
    for _ in range(a.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ids.copy_(_route(t, a))
        distinct.append(int(ids.unique().numel()))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / a.calls)
    us = statistics.median(times)
    return {
        "us": us,
        "spread_us": [min(times), max(times)],
        "gbs": statistics.median(distinct) * nbytes / us / 1e3,
        "expert_mib": nbytes / 2**20,
        "tokens": t,
        "launch": a.launch,
        "config": asdict(cfg),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=20, help="calls per graph replay")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS),
                   metavar="FORMAT", help="the formats to time (default: all)")
    p.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                   help="tokens per call, comma-separated (default 1)")  # fmt: skip
    p.add_argument("--configs", nargs="+", type=_config, default=[MoeConfig()],
                   metavar="N:SB:W", help="block_n:super_blocks:num_warps settings to time")
    p.add_argument("--aligned-only", action="store_true")
    p.add_argument("--launch", choices=("both", "gate_up", "down"), default="both",
                   help="time both launches (a layer's experts) or one alone")  # fmt: skip
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    d2d = copy_rates(1 << 30, torch.device("cuda"))[0]  # read + write
    print(f"{torch.cuda.get_device_name()}: D2D copy {d2d:.0f} GB/s (read + write)")
    print(f"launch: {a.launch}")
    print(f"{'format':22} {'path':10} {'T':>3} {'config':>11} {'us/call':>8} {'spread':>17}"
          f" {'GB/s':>7} {'of D2D':>7}")  # fmt: skip
    out: dict[str, object] = {"d2d_gbs": d2d, "device": torch.cuda.get_device_name()}
    for name in a.formats:
        mix = FORMATS[name]
        for aligned in (True,) if a.aligned_only else (False, True):
            for t in a.tokens:
                for cfg in a.configs:
                    r = time_format(mix, aligned, a, t, cfg, name in Q6_K_SPLIT)
                    path = "aligned" if aligned else "unaligned"
                    tag = config_tag(cfg)
                    launch = "" if a.launch == "both" else f"/{a.launch}"
                    out[f"{name}/{path}/t{t}/{tag}{launch}"] = r
                    lo, hi = r["spread_us"]
                    print(f"{name:22} {path:10} {t:3} {tag:>11} {r['us']:8.1f} {lo:8.1f}-{hi:<8.1f}"
                          f" {r['gbs']:7.0f} {100 * r['gbs'] / d2d:6.1f}%")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
