"""End-to-end speed of the offload engine, next to the ceiling that PCIe and RAM set.

    python -m bench.gpu.e2e --model a3b.gguf --expert-vram-gib 4

Prints decode tokens/s (after a 1K prompt), prefill tokens/s at several lengths, the expert
hit rate, bytes moved per token, and the ceilings, each as the median of --repeats runs
with its spread (min-max). The ceiling for decode counts both miss paths working in
parallel: missed bytes per token over (PCIe bandwidth + the CPU's expert-compute bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.gpu.e2e_report import markdown
from bench.gpu.ram_tier import ram_tier
from kernels.experts.expert_fetch import fetch_experts
from kernels.experts.link_pace import ns_per_blob
from kernels.experts.moe import fused_moe
from stratad.engine.offload.cpu_misses import balanced_frac
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.kernel_table import configs_for_run
from stratad.store.loader import load_model
from stratad.store.placement.hostmem import read_bps


def measure_pcie(gib: float = 1.0) -> dict[str, float]:
    """Host-to-device GB/s: pinned copy, pageable copy, and a kernel reading pinned RAM in place."""
    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, host in (
        ("pinned", torch.empty(n, dtype=torch.uint8).pin_memory()),
        ("pageable", torch.empty(n, dtype=torch.uint8)),
    ):
        host.fill_(1)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = n / statistics.median(times) / 1e9
    del dev
    return out


def measure_miss_reads(  # type: ignore[no-untyped-def]
    model_spec, layouts, host, aligned: bool
) -> dict[str, float]:
    """GB/s of each GPU miss path over all top-k experts of a step in pinned RAM: the fused
    MoE kernel reading them in place, and the fetch kernel copying them into VRAM."""
    k = model_spec.n_experts_used
    layout, slot_bytes = layouts[0], layouts.copy_bytes(0)
    off = torch.tensor([0, layout.up_offset, layout.down_offset])
    in_ram = sorted(host.row_of[0])  # layer 0's experts with a RAM copy
    table = torch.stack([host.blob(0, e).data_ptr() + off for e in in_ram]).cuda()
    span = host.span
    staging = torch.empty((k, slot_bytes), dtype=torch.uint8, device="cuda")
    x = torch.randn(1, model_spec.hidden, device="cuda", dtype=torch.bfloat16)
    weights = torch.full((1, k), 1.0 / k, device="cuda")
    paths = {
        "inplace": lambda ids: fused_moe(
            x, ids, weights, table, model_spec.expert_ffn, aligned=aligned, fmt=layout.fmt
        ),
        "fetch": lambda ids: fetch_experts(ids, table, span, staging, slot_bytes),
    }
    rates = {}
    for name, run in paths.items():
        times = []
        for r in range(12):
            ids = torch.randperm(len(in_ram))[:k].to(torch.int32)[None].cuda()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(ids)
            torch.cuda.synchronize()
            if r >= 2:  # the first calls compile
                times.append(time.perf_counter() - t0)
        rates[name] = k * layout.nbytes / statistics.median(times) / 1e9
    return rates


def top_kernels(prof, steps: int, n: int = 12) -> list[list[object]]:  # type: ignore[no-untyped-def]
    """The GPU kernels a `torch.profiler` run saw over `steps` steps: all of them summed, then
    the top n by time, each as [name, ms per step, launches per step]."""
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / steps / 1e3
    launches = sum(e.count for e in rows) / steps
    out: list[list[object]] = [["(all kernels)", round(total, 3), launches]]
    for e in rows[:n]:
        out.append([e.key[:70], round(e.device_time_total / steps / 1e3, 3), e.count / steps])
    return out


def kernel_profile(engine: OffloadForward, cache, prompt) -> dict[str, list[list[object]]]:  # type: ignore[no-untyped-def]
    """The GPU kernels of 8 eager decode steps and of one 4K prefill chunk: the top 12 by
    time, as [name, ms per step (or chunk), launches per step]."""

    from torch.profiler import ProfilerActivity, profile

    graphs, engine.config = engine.config.graphs, replace(engine.config, graphs=False)
    cache.length = 0
    cache.tokens.clear()
    logits = engine(prompt(1024), cache)[0]
    token = int(logits.argmax())
    engine([token], cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine([token], cache)
        torch.cuda.synchronize()
    decode = top_kernels(prof, 8)
    cache.length = 0
    cache.tokens.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine(prompt(4096), cache)
        torch.cuda.synchronize()
    engine.config = replace(engine.config, graphs=graphs)
    return {"decode step": decode, "prefill chunk of 4,096": top_kernels(prof, 1)}


def stage_timing(engine: OffloadForward, cache, prompt, args) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    """Milliseconds by stage for one prefill and per decode step, timed eagerly (no graph:
    every stage bracketed by events), to see which stage holds a figure back."""

    from stratad.engine.timing import StageTimer

    graphs, engine.config = engine.config.graphs, replace(engine.config, graphs=False)
    engine.timer = StageTimer(enabled=True)
    n = max(args.prefill_lens)
    cache.length = 0
    cache.tokens.clear()
    logits = engine(prompt(min(n, 8192)), cache)[0]
    prefill = engine.timer.collect()
    engine.timer.reset()
    steps = 32
    for _ in range(steps):
        logits = engine([int(logits.argmax())], cache)[0]
    decode = {k: v / steps for k, v in engine.timer.collect().items()}
    engine.timer = StageTimer(enabled=False)
    engine.config = replace(engine.config, graphs=graphs)
    return {"prefill_8k_ms": prefill, "decode_ms_per_step": decode}


def context_needed(args: argparse.Namespace) -> int:
    """The KV cache every run asks for: the longest prompt (the profile's prefill chunk is
    4,096), plus room for the decode steps that follow one (timing takes 32)."""
    longest = [*args.prefill_lens, args.prompt_len + args.decode_tokens]
    if args.profile:
        longest.append(4096)
    return max(longest) + 64


def run(args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    model = load_model(Path(args.model))
    spec = model.spec
    configs = configs_for_run(args.kernel_table, model.spec)
    if args.prefetch_programs:
        programs = args.prefetch_programs
        configs = replace(configs, prefetch=replace(configs.prefetch, programs=programs))
    cfg = OffloadConfig(
        expert_vram_bytes=int(args.expert_vram_gib * 2**30),
        max_context=context_needed(args),
        prefill_chunk=args.prefill_chunk,
        graphs=not args.no_graphs,
        pcie_frac=1.0,  # set once the rates are measured
        cpu_threads=args.cpu_threads,
        gpu_miss=args.gpu_miss,
        kernels=configs,
        prefetch=args.prefetch == "on" and args.gpu_miss == "copy"
        and not args.link_gbs,
        q6_k_split=args.q6_k_layout == "split",
        dense_gguf=args.dense_form == "gguf",
    )
    ram, warning = ram_tier(model, cfg, args.ram_frac)
    t0 = time.monotonic()
    engine = OffloadForward(model, torch.device("cuda"), cfg, ram=ram)
    load_s = time.monotonic() - t0
    bw = measure_pcie()
    reads = measure_miss_reads(spec, engine.layouts, engine.ram, engine._aligned)
    cpu_bw = engine.measure_cpu_expert_bps() / 1e9
    host_gbs = read_bps() / 1e9
    gpu_miss_gbs = reads["fetch"] if args.gpu_miss == "copy" else reads["inplace"]
    if args.link_gbs:
        wait = ns_per_blob(engine.layouts.mean_nbytes, args.link_gbs * 1e9, reads["fetch"] * 1e9)
        engine.config = replace(engine.config, link_wait_ns_per_blob=wait)
        gpu_miss_gbs = min(gpu_miss_gbs, args.link_gbs)
        bw["pinned"] = min(bw["pinned"], args.link_gbs)  # the ceilings take the slower link
    frac = {"off": 1.0, "balanced": "auto", None: args.pcie_frac}[args.cpu_split]
    if frac == "auto":
        frac = balanced_frac(cpu_bw, gpu_miss_gbs)
    engine.set_pcie_frac(float(frac))
    gen = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()

    cache = engine.new_cache()
    decode_tps, hit_rates, guessed = [], [], []
    for _ in range(args.repeats):
        cache.length = 0
        cache.tokens.clear()
        logits = engine(prompt(args.prompt_len), cache)[0]
        engine.experts.forget_lookups()
        token = int(logits.argmax())
        logits = engine([token], cache)[0]  # the first step captures the graph
        torch.cuda.synchronize()
        engine.experts.forget_lookups()  # the capture step's accounting stays out of the window
        engine.prefetch.reset_score()
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            token = int(logits.argmax())
            logits = engine([token], cache)[0]
        torch.cuda.synchronize()
        decode_tps.append(args.decode_tokens / (time.perf_counter() - t))
        hit_rates.append(engine.experts.hit_rate)
        guessed.append(engine.prefetch.accuracy())
    hit = statistics.median(hit_rates)
    per_token = spec.n_layers * spec.n_experts_used * engine.layouts.mean_nbytes
    missed = (1 - hit) * per_token
    # The ceiling is what the link allows (the copy engine's pinned rate), not what our own
    # kernel reaches reading in place: that one is reported beside it as a measurement.
    ceiling_pcie = bw["pinned"] * 1e9 / missed if missed else float("inf")
    ceiling_both = (bw["pinned"] + cpu_bw) * 1e9 / missed if missed else float("inf")

    prefill = {}
    resident = engine.experts.n_slots / (spec.n_layers * spec.n_experts)
    for n in args.prefill_lens:
        tps = []
        for _ in range(args.repeats):
            cache.length = 0
            cache.tokens.clear()
            p = prompt(n)
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine(p, cache)
            torch.cuda.synchronize()
            tps.append(n / (time.perf_counter() - t))
        chunks = -(-n // args.prefill_chunk)
        blobs = chunks * spec.n_layers * spec.n_experts * (1 - resident)
        moved = blobs * engine.layouts.mean_nbytes
        prefill[n] = (tps, n / (moved / (bw["pinned"] * 1e9)) if moved else float("inf"), moved)
    timing = stage_timing(engine, cache, prompt, args) if args.timing else {}
    kernels = kernel_profile(engine, cache, prompt) if args.profile else {}
    result = {
        "coverage": warning,
        "file_reads": engine.ram.file_reads,
        "timing": timing,
        "kernels": kernels,
        "gpu_miss": args.gpu_miss,
        "decode_tokens": args.decode_tokens,
        "prompt_len": args.prompt_len,
        "prefetch": engine.prefetch.enabled,
        "prefetch_programs": configs.prefetch.programs,
        "fetch_gbs": reads["fetch"],
        "model": str(args.model),
        "expert_vram_gib": args.expert_vram_gib,
        "slots_per_layer": engine.experts.n_slots // spec.n_layers,
        "n_experts": spec.n_experts,
        "blob_mib": engine.layouts.mean_nbytes / 2**20,
        "expert_types": [q.name for q in engine.layouts.qtypes()],
        "load_s": load_s,
        "pcie_pinned_gbs": bw["pinned"],
        "pcie_pageable_gbs": bw["pageable"],
        "inplace_gbs": reads["inplace"],
        "cpu_expert_gbs": cpu_bw,
        "cpu_math": engine.cpu_math,
        "host_read_gbs": host_gbs,
        "pcie_frac": engine.config.pcie_frac,
        "pcie_frac_setting": args.pcie_frac,
        "link_gbs": args.link_gbs,
        "link_wait_ns_per_blob": engine.config.link_wait_ns_per_blob,
        "decode_tps": decode_tps,
        "hit_rate": hit,
        "prefetch_guessed": statistics.median(guessed),
        "missed_mb_per_token": missed / 1e6,
        "decode_ceiling_pcie": ceiling_pcie,
        "decode_ceiling_both": ceiling_both,
        "prefill": {
            str(n): {"tps": v[0], "ceiling": v[1], "moved_gb": v[2] / 1e9}
            for n, v in prefill.items()
        },
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    return result


def add_split_arguments(p: argparse.ArgumentParser, gpu_rate: str) -> None:
    """--pcie-frac and --cpu-threads: the GPU's share of the decode misses, the CPU computing
    the rest (auto: balanced by the CPU's measured rate and `gpu_rate`), and the CPU's
    threads."""
    p.add_argument(
        "--pcie-frac",
        type=lambda v: v if v == "auto" else float(v),
        default=1.0,
        help="share of decode misses the GPU takes; the CPU computes the rest; auto: balanced"
        f" by the measured rates (the CPU's, and {gpu_rate})",
    )
    p.add_argument(
        "--cpu-threads", type=int, help="threads of the CPU expert kernels (default: every core)"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.e2e", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--expert-vram-gib", type=float, default=4.0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument(
        "--prefill-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192, 32768]
    )
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument(
        "--timing",
        action="store_true",
        help="also time each stage of one 8K prefill and 32 decode steps (no graph)",
    )
    add_split_arguments(p, "the GPU miss path's: the fetch kernel's, or --link-gbs")
    p.add_argument(
        "--link-gbs",
        type=float,
        help="emulate a slower PCIe link: each blob the decode miss copy moves also waits on"
        " the GPU for the time this rate would add (kernels.experts.link_pace; turns prefetch off)",
    )
    p.add_argument(
        "--gpu-miss",
        choices=["copy", "in_place"],
        default="copy",
        help="how the GPU gets decode misses: fetch into VRAM, or read in place",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also list the GPU kernels of a decode step and a prefill chunk",
    )
    p.add_argument(
        "--prefetch",
        choices=["on", "off"],
        default="on",
        help="guess experts one layer early (engine.expert_prefetch, the switch a table"
        " records); on by default with the copy miss path, as in the daemon",
    )
    p.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_const",
        const="off",
        help="as --prefetch off",
    )
    p.add_argument(
        "--cpu-split",
        choices=["off", "balanced"],
        help="the switch cpu_split as a table records it: off is --pcie-frac 1, balanced is"
        " --pcie-frac auto (overrides --pcie-frac)",
    )
    p.add_argument(
        "--q6-k-layout",
        choices=["blocks", "split"],
        default="blocks",
        help="the switch q6_k_layout as a table records it: the experts' Q6_K projections as"
        " GGUF blocks or split (OffloadConfig.q6_k_split; the kernel table must dot Q6_K in int8)",
    )
    p.add_argument(
        "--prefetch-programs",
        type=int,
        help="programs per blob of the prefetch copy (kernels.prefetch.programs)",
    )
    p.add_argument(
        "--kernel-table",
        help="launch settings: a tuning table file (stratactl tune), or builtin for the"
        " built-in ones; default: the table the daemon picks for this model on this stack",
    )
    p.add_argument(
        "--ram-frac",
        type=float,
        default=1.0,
        help="RAM holds this share of the expert blobs (as the daemon's plan places them);"
        " the rest are read from the model file on use",
    )
    p.add_argument("--dense-form", choices=["bf16", "gguf"], default="bf16",
                   help="the attention projections and the head dequantized (bf16) or held as"
                   " their GGUF blocks alone (gguf: decode dots them in int8, prefill"
                   " dequantizes slices; the switch dense_form)")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
