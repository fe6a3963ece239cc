"""`stratactl bench kernels`: which kernel is slow on this device, in one table.

Measures the device's ceilings (host→device copy from page-locked RAM, device→device copy,
the bf16/fp16 matmul rate, the launch floor), then times every kernel the offload engine
launches at a model's shapes, decode and prefill, for each GGUF type its experts hold. Each
kernel's achieved GB/s or TFLOP/s is printed as a share of the ceiling that bounds it; a
kernel under `--flag-below` is flagged. `--json PATH` writes the whole report (versions,
device, ceilings, every row) for a bug report. Meant to take under two minutes on a GPU
(the timing budget per kernel is fixed; not yet run on one).

Without a GPU it runs on the CPU, the Triton kernels in Triton's interpreter, at small
context and prefill lengths: that checks the command works, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from stratactl.client import fail

GROUPS = ("linear", "norm", "rope", "attention", "router", "moe", "fetch", "dequant", "grouped")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks of this device (bench kernels)",
                              description="Benchmarks of this device.")  # fmt: skip
    sub = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    k = sub.add_parser("kernels", help="time every kernel against the device's ceilings",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    k.add_argument("--model", default="a3b", metavar="M",
                   help="a model file (GGUF, pack or HF directory; its header and types only)"
                        " or a synth preset name (default a3b: its shapes in Q4_0)")  # fmt: skip
    k.add_argument("--json", type=Path, metavar="PATH", help="write the whole report here")
    k.add_argument("--flag-below", type=float, default=0.3, metavar="SHARE",
                   help="flag a kernel under this share of its ceiling (default 0.3)")
    k.add_argument("--kernels", default=",".join(GROUPS),
                   help=f"comma-separated subset of: {', '.join(GROUPS)}")
    k.add_argument("--quick", action="store_true",
                   help="smaller ceilings' buffers, a 1K prefill chunk, shorter timing")
    k.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    groups = tuple(g.strip() for g in args.kernels.split(",") if g.strip())
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown or not groups:
        known = ", ".join(GROUPS)
        return fail(f"--kernels: unknown {', '.join(unknown) or '(none)'} (known: {known})")
    if not 0 <= args.flag_below <= 1:
        return fail("--flag-below: a share between 0 and 1")
    from stratad.model.synth_presets import PRESETS

    if args.model not in PRESETS and not Path(args.model).exists():
        presets = ", ".join(PRESETS)
        return fail(f"--model {args.model}: no such model file (nor a synth preset: {presets})")
    import torch  # the measurement needs the device runtime; other verbs start without it

    gpu = torch.cuda.is_available()
    if not gpu:  # before Triton is imported: its kernels then run on the CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        shapes, source = _shapes(args.model)
    except ValueError as err:  # ModelError, UnknownPreset
        return fail(str(err))
    device = torch.device("cuda" if gpu else "cpu")
    return _bench(args, groups, shapes, source, device, started)


def _shapes(model: str) -> tuple[Any, dict[str, Any]]:
    """The shapes to time at, and what they came from."""
    from stratad.model.synth_presets import PRESETS, VOCAB_SIZE
    from stratad.tuning.kernel_bench import BenchShapes, expert_mixes

    if model in PRESETS and not Path(model).exists():
        from kernels.quant import QType

        p = PRESETS[model]
        if not p.is_moe:
            raise ValueError(f"preset {model}: not a mixture-of-experts model")
        mix = (QType(int(p.ffn_qtype)),) * 3
        shapes = BenchShapes(p.hidden, p.n_heads, p.n_kv_heads, p.head_dim, p.ffn, p.n_experts,
                             p.n_experts_used, VOCAB_SIZE, p.qk_norm, (mix,))  # fmt: skip
        return shapes, {"preset": model}
    from stratad.model.loader import load_model

    m = load_model(Path(model))  # the tensors are views of the mapped file: nothing is read
    if not m.spec.is_moe:
        raise ValueError(f"{model}: not a mixture-of-experts model")
    return BenchShapes.of(m.spec, expert_mixes(m)), {"file": str(model), "arch": m.spec.arch}


def _bench(args: argparse.Namespace, groups: tuple[str, ...], shapes: Any,
           source: dict[str, Any], device: Any, started: float) -> int:  # fmt: skip
    import dataclasses

    import torch

    from kernels.roofline import judge, measure_ceilings, table
    from stratad.tuning.kernel_bench import run_cases

    gpu = device.type == "cuda"
    if not gpu:  # the interpreter: short context and prefill, a small head, 8 staged experts
        shapes = dataclasses.replace(shapes, context=64, cache=128, prefill=16,
                                     vocab=min(shapes.vocab, 1024), staged=8)  # fmt: skip
    elif args.quick:
        shapes = dataclasses.replace(shapes, prefill=1024)
    say = _progress
    name = torch.cuda.get_device_name(device) if gpu else "cpu (Triton interpreter)"
    say(f"device: {name}" + ("" if gpu else ": the timings say nothing about a GPU"))
    say(f"shapes: {shapes.describe()}")
    ceilings = measure_ceilings(device, quick=args.quick or not gpu)
    say(f"ceilings: H2D {ceilings.h2d_gbs:.1f} GB/s, D2D {ceilings.d2d_gbs:.1f} GB/s, matmul "
        + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in ceilings.matmul_tflops.items())
        + f", launch {ceilings.launch_us:.1f} us")  # fmt: skip
    cfg, settings = _settings(shapes, gpu)
    say(f"launch settings: {settings}")
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = run_cases(shapes, device, dtype, cfg, groups, say, rep_ms=10 if args.quick else 20)
    judged = [judge(r, ceilings, args.flag_below) for r in rows]
    print(f"device: {name}" + ("" if gpu else " - interpreter timings are not meaningful"))
    print(table(judged, args.flag_below))
    seconds = time.perf_counter() - started
    print(f"{seconds:.1f} s", flush=True)
    if args.json is not None:
        report = _report(name, gpu, source, shapes, ceilings, judged, args.flag_below, seconds)
        report["launch_settings"] = settings
        try:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as err:
            return fail(f"cannot write {args.json}: {err}")
        say(f"wrote {args.json}")
    return 0


def _settings(shapes: Any, gpu: bool) -> tuple[Any, str]:
    """The launch settings the daemon would take here (its tuning table's bucket nearest
    these shapes), and the line that says which."""
    import dataclasses

    from kernels.tuning import KernelConfigs
    from stratad.engine.offload.kernel_table import Shapes, lookup, this_stack
    from stratad.tuning.kernel_bench import INTERPRETED_BENCH

    if not gpu:
        return INTERPRETED_BENCH, "the interpreter's (wide programs, few of them)"
    stack = this_stack()
    if isinstance(stack, str):
        return KernelConfigs(), f"the defaults: {stack}"
    tuned = Shapes(shapes.hidden, shapes.ffn, shapes.top_k, shapes.n_heads, shapes.n_kv_heads,
                   shapes.head_dim, shapes.n_experts)  # fmt: skip
    found = lookup(stack, dataclasses.asdict(tuned))
    return found.configs, found.message


def _report(name: str, gpu: bool, source: dict[str, Any], shapes: Any, ceilings: Any,
            judged: list[Any], flag_below: float, seconds: float) -> dict[str, Any]:  # fmt: skip
    import dataclasses
    import importlib.metadata
    import platform

    import torch
    import triton

    try:
        strata = importlib.metadata.version("strata")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        strata = "source tree"
    shape = {k: v for k, v in dataclasses.asdict(shapes).items() if k != "mixes"}
    shape["mixes"] = [[q.name for q in mix] for mix in shapes.mixes]
    return {
        "schema": 1,
        "seconds": round(seconds, 2),
        "versions": {"strata": strata, "torch": torch.__version__,
                     "triton": triton.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda, "hip": torch.version.hip},  # fmt: skip
        "device": {"name": name, "type": "cuda" if gpu else "cpu", "interpreted": not gpu},
        "model": {**source, "shapes": shape},
        "ceilings": dataclasses.asdict(ceilings),
        "flag_below": flag_below,
        "rows": [j.to_json() for j in judged],
        "flagged": [f"{j.row.phase} {j.row.kernel}" for j in judged if j.flagged],
    }


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
