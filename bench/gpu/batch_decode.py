"""Decode throughput of the offload engine with B sequences per step.

    python -m bench.gpu.batch_decode --model a3b.gguf --expert-vram-gib 4 --batches 1,2,4,8

Each of B sequences gets its own random prompt of --prompt-len tokens (prefilled as one
batch), then the whole batch decodes --decode-tokens steps. Printed per B: the aggregate
tokens/s (B x steps over the time) and the step time, each the median of --repeats with
the spread; `--profile` adds the GPU kernels of 8 eager steps of each B (torch.profiler: the
top 12 by time per step).
A step reads each routed expert once for all of its tokens, so the ceiling of B sequences
is B times the one-sequence rate (every token routed to the same experts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.gpu.e2e import add_split_arguments, measure_miss_reads, top_kernels
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache, pool_tokens
from stratad.engine.kv_format import FORMATS
from stratad.engine.offload.cpu_misses import balanced_frac
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.kernel_table import configs_for_run
from stratad.store.loader import load_model


def _spread(xs: list[float]) -> dict[str, object]:
    return {"median": statistics.median(xs), "spread": [min(xs), max(xs)], "samples": xs}


def measure(engine: OffloadForward, b: int, args: argparse.Namespace) -> dict[str, object]:
    spec = engine.spec
    gen = torch.Generator().manual_seed(b)
    n = _capacity(args)
    pool = engine.new_pool(pool_tokens(b, n))  # one pool, as the daemon's: one launch a step
    caches = [KVCache(pool, n) for _ in range(b)]
    tps, step_ms, prefill_s = [], [], []
    for _ in range(args.repeats):
        for c in caches:
            c.truncate(0)
        prompts = [torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(b)]  # fmt: skip
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = engine.step([Seq(c, p) for c, p in zip(caches, prompts, strict=True)])
        torch.cuda.synchronize()
        prefill_s.append(time.perf_counter() - t)
        tokens = [int(lg[-1].argmax()) for lg in logits]
        logits = engine.step([Seq(c, [t]) for c, t in zip(caches, tokens, strict=True)])  # capture
        torch.cuda.synchronize()
        engine.experts.flush()
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            tokens = [int(lg[-1].argmax()) for lg in logits]
            logits = engine.step([Seq(c, [x]) for c, x in zip(caches, tokens, strict=True)])
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tps.append(b * args.decode_tokens / dt)
        step_ms.append(1e3 * dt / args.decode_tokens)
    row: dict[str, object] = {
        "batch": b, "tok_s": _spread(tps), "step_ms": _spread(step_ms),
        "prefill_s": _spread(prefill_s), "kv_vram_gib": pool.nbytes / 2**30,
        "kv_host_gib": pool.host_nbytes / 2**30,
    }  # fmt: skip
    if args.profile:
        row["kernels"] = _profile(engine, caches, logits)
    return row


def _capacity(args: argparse.Namespace) -> int:
    """Each sequence's cache: what the run writes, or --cache-tokens where larger (a short
    context in a long cache, as the daemon's caches are its max_context)."""
    return max(args.prompt_len + args.decode_tokens + 16, args.cache_tokens)


def _profile(engine: OffloadForward, caches: list[KVCache], logits) -> list[list[object]]:  # type: ignore[no-untyped-def]
    """The GPU kernels of 8 eager steps (no graph: each launch is its own profiler event)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.config = engine.config.graphs, replace(engine.config, graphs=False)
    tokens = [int(lg[-1].argmax()) for lg in logits]
    logits = engine.step([Seq(c, [x]) for c, x in zip(caches, tokens, strict=True)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            tokens = [int(lg[-1].argmax()) for lg in logits]
            logits = engine.step([Seq(c, [x]) for c, x in zip(caches, tokens, strict=True)])
        torch.cuda.synchronize()
    engine.config = replace(engine.config, graphs=graphs)
    return top_kernels(prof, 8)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.batch_decode", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--expert-vram-gib", type=float, default=4.0)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the GPU kernels of each B")
    p.add_argument(
        "--kernel-table",
        help="launch settings: a tuning table file (stratactl tune), or builtin for the"
        " built-in ones; default: the table the daemon picks for this model on this stack",
    )
    p.add_argument(
        "--dense-form",
        choices=["bf16", "gguf"],
        default="bf16",
        help="the attention projections and the head dequantized (bf16) or held as their GGUF"
        " blocks alone (gguf: decode dots them in int8, prefill dequantizes slices; the switch"
        " dense_form, OffloadConfig.dense_gguf)",
    )
    p.add_argument(
        "--q6-k-layout",
        choices=["blocks", "split"],
        default="blocks",
        help="the experts' Q6_K projections as GGUF blocks or split (the switch q6_k_layout,"
        " OffloadConfig.q6_k_split; the kernel table must dot Q6_K in int8)",
    )
    p.add_argument("--kv-cache", choices=list(FORMATS), default="plain",
                   help="how the pool stores keys and values (engine.kv_cache)")
    p.add_argument("--kv-resident", type=int, default=0,
                   help="tokens of each sequence's newest KV in VRAM, the rest in page-locked"
                   " RAM read over PCIe (engine.kv_resident); 0: all in VRAM")  # fmt: skip
    p.add_argument("--cache-tokens", type=int, default=0,
                   help="each sequence's cache capacity where larger than the run needs")
    add_split_arguments(p, "the GPU's miss copy, as the daemon's cpu_split = balanced")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    model = load_model(Path(args.model))
    configs = configs_for_run(args.kernel_table, model.spec)
    cfg = OffloadConfig(
        expert_vram_bytes=int(args.expert_vram_gib * 2**30),
        max_context=_capacity(args),
        prefill_chunk=4096,
        graphs=not args.no_graphs,
        kernels=configs,
        dense_gguf=args.dense_form == "gguf",
        q6_k_split=args.q6_k_layout == "split",
        kv_format=FORMATS[args.kv_cache],
        kv_resident=args.kv_resident,
        cpu_threads=args.cpu_threads,
    )
    engine = OffloadForward(model, torch.device("cuda"), cfg)
    if args.pcie_frac != 1.0:
        frac = args.pcie_frac
        if frac == "auto":
            cpu = engine.measure_cpu_expert_bps()
            gpu = measure_miss_reads(model.spec, engine.layouts, engine.ram, engine._aligned)
            frac = balanced_frac(cpu, gpu["fetch"] * 1e9)
            print(f"CPU experts {cpu / 1e9:.2f} GB/s, the GPU's miss copy {gpu['fetch']:.2f}"
                  f" GB/s: pcie_frac {frac:.2f}")  # fmt: skip
        engine.set_pcie_frac(float(frac))
    rows = [measure(engine, b, args) for b in args.batches]
    one = next((r for r in rows if r["batch"] == 1), None)
    print(f"expert VRAM {args.expert_vram_gib} GiB, {engine.experts.n_slots} slots, graphs"
          f" {cfg.graphs}; {args.decode_tokens} steps after {args.prompt_len}-token prompts;"
          f" KV {cfg.kv_format.name}, resident window"
          f" {cfg.kv_resident or 'all'}; peak VRAM allocated"
          f" {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")  # fmt: skip
    print("| B | tok/s (all sequences) | ms/step | ceiling (B x B=1) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        t, s = r["tok_s"], r["step_ms"]
        assert isinstance(t, dict) and isinstance(s, dict)
        ceiling = ""
        if one is not None:
            t1 = one["tok_s"]
            assert isinstance(t1, dict)
            ceiling = f"{r['batch'] * t1['median']:,.1f}"  # type: ignore[operator]
        lo, hi = t["spread"]  # type: ignore[misc]
        print(f"| {r['batch']} | {t['median']:,.1f} ({lo:,.1f}–{hi:,.1f}) | "
              f"{s['median']:.2f} | {ceiling} |")  # fmt: skip
    for r in rows:
        pf = r["prefill_s"]
        assert isinstance(pf, dict)
        print(f"B = {r['batch']}: prefill {pf['median']:.2f} s ({r['batch']} x"
              f" {args.prompt_len} tokens); KV pool {r['kv_vram_gib']:.2f} GiB in VRAM,"
              f" {r['kv_host_gib']:.2f} GiB in page-locked RAM")  # fmt: skip
    for r in rows:
        if "kernels" in r:
            print(f"\nGPU kernels of one eager step, B = {r['batch']} (ms, launches):")
            for name, ms, count in r["kernels"]:  # type: ignore[attr-defined]
                print(f"  {ms:8.3f}  {count:6.1f}  {name}")
    if args.json:
        given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        # each batch's repeats under a name of its own too, as `bench.gpu.ab_switch --metric`
        # reads a figure (tok_s_b8)
        figures = {f"tok_s_b{r['batch']}": r["tok_s"]["samples"] for r in rows}  # type: ignore[index]
        peak = torch.cuda.max_memory_allocated() / 2**30
        args.json.write_text(json.dumps({"args": given, "rows": rows, **figures,
                                         "peak_vram_gib": peak}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
