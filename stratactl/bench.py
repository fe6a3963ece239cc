"""`stratactl bench kernels`: which kernel is slow on this device, in one table.

Measures the device's ceilings (host→device copy from page-locked RAM, device→device copy,
the bf16/fp16 matmul rate, the launch floor), then times every kernel the offload engine
launches at a model's shapes, decode and prefill, for each GGUF type its experts hold. Each
kernel's achieved GB/s or TFLOP/s is printed as a share of the ceiling that bounds it; a
kernel under `--flag-below` is flagged. `--json PATH` writes the whole report (versions,
device, ceilings, every row) for a bug report. Meant to take under two minutes on a GPU
(the timing budget per kernel is fixed; not yet run on one).

On a host without a GPU it benchmarks the cpu engine's kernels instead (the compiled ones
that serve there, `stratad.tuning.cpu_kernel_bench`): each weight product at the model's
shapes and types, at a decode step, a step of 4 and of 8 sequences and a prefill chunk, held
to the host's measured memory read rate, a float32 GEMM's rate and the floor of a call. The
GPU kernels are not timed there (Triton's interpreter would say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
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
    from stratad.model.synthetic.presets import PRESETS

    if args.model not in PRESETS and not Path(args.model).exists():
        presets = ", ".join(PRESETS)
        return fail(f"--model {args.model}: no such model file (nor a synth preset: {presets})")
    from kernels.cpu.build import quiet_openmp

    quiet_openmp()  # before torch's import: its OpenMP team must not spin beside the kernels'
    import torch  # the measurement needs the device runtime; other verbs start without it

    if not torch.cuda.is_available():
        return _bench_cpu(args, groups, started)
    try:
        shapes, source = _shapes(args.model)
    except ValueError as err:  # ModelError, UnknownPreset
        return fail(str(err))
    return _bench(args, groups, shapes, source, torch.device("cuda"), started)


def _bench_cpu(args: argparse.Namespace, groups: tuple[str, ...], started: float) -> int:
    """The cpu engine's kernels against the host's ceilings (no GPU here)."""
    from kernels.cpu.build import CpuKernelsUnavailable
    from kernels.cpu.experts import CpuExperts
    from kernels.tuning.roofline import judge
    from stratad.tuning import cpu_kernel_bench as cb

    cpu_groups = tuple(g for g in groups if g in cb.GROUPS)
    if not cpu_groups:
        return fail(f"--kernels {args.kernels}: no kernel of the cpu engine among them (it runs"
                    f" {' and '.join(cb.GROUPS)}); the GPU kernels need a GPU")  # fmt: skip
    try:
        shapes, source = _cpu_shapes(args.model)
        kernels = CpuExperts()
    except (ValueError, CpuKernelsUnavailable) as err:  # ModelError, UnknownPreset
        return fail(str(err))
    say = _progress
    name = f"{cb.cpu_name()} ({kernels.threads} threads)"
    say(f"device: {name}: the cpu engine's kernels")
    say(f"shapes: {shapes.describe()}")
    ceilings = cb.measure_ceilings(kernels, quick=args.quick)
    say(f"ceilings: read {ceilings.read_gbs:.1f} GB/s, float32 matmul"
        f" {ceilings.matmul('float32') * 1e3:.0f} GFLOP/s, call {ceilings.launch_us:.1f} us")
    working = (2 if args.quick else 4) * cb.last_level_cache()
    rows = cb.run_cases(shapes, kernels, working, cpu_groups, say,
                        budget_s=0.05 if args.quick else 0.2)  # fmt: skip
    judged = [judge(r, ceilings, args.flag_below) for r in rows]
    print(f"device: {name}: the cpu engine's kernels against the host's read rate"
          f" ({ceilings.read_gbs:.1f} GB/s)")  # fmt: skip
    print("the GPU kernels are not benchmarked on a CPU host")
    print(cb.table(judged, args.flag_below, ceilings.read_gbs))
    seconds = time.perf_counter() - started
    print(f"{seconds:.1f} s", flush=True)
    if args.json is not None:
        report = _cpu_report(name, kernels.threads, source, shapes, ceilings, judged,
                             args.flag_below, seconds)  # fmt: skip
        try:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as err:
            return fail(f"cannot write {args.json}: {err}")
        say(f"wrote {args.json}")
    return 0


def _cpu_shapes(model: str) -> tuple[Any, dict[str, Any]]:
    """The cpu engine's products of a preset or a model file, and what they came from."""
    from stratad.model.synthetic.presets import PRESETS
    from stratad.tuning.cpu_kernel_bench import CpuShapes

    if model in PRESETS and not Path(model).exists():
        return CpuShapes.of_preset(PRESETS[model]), {"preset": model}
    from stratad.store.loader import load_model

    m = load_model(Path(model))  # the tensors are views of the mapped file: nothing is read
    return CpuShapes.of_model(m), {"file": str(model), "arch": m.spec.arch}


def _shapes(model: str) -> tuple[Any, dict[str, Any]]:
    """The shapes to time at, and what they came from."""
    from stratad.model.synthetic.presets import PRESETS, VOCAB_SIZE
    from stratad.tuning.kernel_bench import BenchShapes, expert_mixes

    if model in PRESETS and not Path(model).exists():
        from kernels.formats.quant import QType

        p = PRESETS[model]
        if not p.is_moe:
            raise ValueError(f"preset {model}: not a mixture-of-experts model")
        mix = (QType(int(p.ffn_qtype)),) * 3
        shapes = BenchShapes(p.hidden, p.n_heads, p.n_kv_heads, p.head_dim, p.ffn, p.n_experts,
                             p.n_experts_used, VOCAB_SIZE, p.qk_norm, (mix,))  # fmt: skip
        return shapes, {"preset": model}
    from stratad.store.loader import load_model

    m = load_model(Path(model))  # the tensors are views of the mapped file: nothing is read
    if not m.spec.is_moe:
        raise ValueError(f"{model}: not a mixture-of-experts model")
    return BenchShapes.of(m.spec, expert_mixes(m)), {"file": str(model), "arch": m.spec.arch}


def _bench(args: argparse.Namespace, groups: tuple[str, ...], shapes: Any,
           source: dict[str, Any], device: Any, started: float) -> int:  # fmt: skip
    import dataclasses

    import torch

    from kernels.tuning.roofline import judge, measure_ceilings, table
    from stratad.tuning.kernel_bench import run_cases

    if args.quick:
        shapes = dataclasses.replace(shapes, prefill=1024)
    say = _progress
    name = torch.cuda.get_device_name(device)
    say(f"device: {name}")
    say(f"shapes: {shapes.describe()}")
    ceilings = measure_ceilings(device, quick=args.quick)
    say(f"ceilings: H2D {ceilings.h2d_gbs:.1f} GB/s, D2D {ceilings.d2d_gbs:.1f} GB/s, matmul "
        + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in ceilings.matmul_tflops.items())
        + f", launch {ceilings.launch_us:.1f} us")  # fmt: skip
    cfg, settings = _settings(shapes)
    say(f"launch settings: {settings}")
    rows = run_cases(shapes, device, torch.bfloat16, cfg, groups, say,
                     rep_ms=10 if args.quick else 20)  # fmt: skip
    judged = [judge(r, ceilings, args.flag_below) for r in rows]
    print(f"device: {name}")
    print(table(judged, args.flag_below))
    seconds = time.perf_counter() - started
    print(f"{seconds:.1f} s", flush=True)
    if args.json is not None:
        report = _report(name, source, shapes, ceilings, judged, args.flag_below, seconds)
        report["launch_settings"] = settings
        try:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as err:
            return fail(f"cannot write {args.json}: {err}")
        say(f"wrote {args.json}")
    return 0


def _settings(shapes: Any) -> tuple[Any, str]:
    """The launch settings the daemon would take here (its tuning table's bucket nearest
    these shapes), and the line that says which."""
    import dataclasses

    from kernels.tuning.configs import KernelConfigs
    from stratad.engine.offload.kernel_table import Shapes, lookup, this_stack

    stack = this_stack()
    if isinstance(stack, str):
        return KernelConfigs(), f"the defaults: {stack}"
    tuned = Shapes(shapes.hidden, shapes.ffn, shapes.top_k, shapes.n_heads, shapes.n_kv_heads,
                   shapes.head_dim, shapes.n_experts)  # fmt: skip
    found = lookup(stack, dataclasses.asdict(tuned))
    return found.configs, found.message


def _report(name: str, source: dict[str, Any], shapes: Any, ceilings: Any,
            judged: list[Any], flag_below: float, seconds: float) -> dict[str, Any]:  # fmt: skip
    import dataclasses

    import torch
    import triton

    shape = {k: v for k, v in dataclasses.asdict(shapes).items() if k != "mixes"}
    shape["mixes"] = [[q.name for q in mix] for mix in shapes.mixes]
    versions = {"triton": triton.__version__, "cuda": torch.version.cuda,
                "hip": torch.version.hip}  # fmt: skip
    ceiling = {k: v for k, v in dataclasses.asdict(ceilings).items() if k != "read_gbs"}
    return _common(seconds, versions, {"name": name, "type": "cuda"}, {**source, "shapes": shape},
                   ceiling, judged, flag_below)  # fmt: skip


def _cpu_report(name: str, threads: int, source: dict[str, Any], shapes: Any, ceilings: Any,
                judged: list[Any], flag_below: float,
                seconds: float) -> dict[str, Any]:  # fmt: skip
    import dataclasses

    shape = {"hidden": shapes.hidden, "ffn": shapes.ffn, "n_experts": shapes.n_experts,
             "top_k": shapes.top_k, "prefill": shapes.prefill,
             "products": [{"names": p.names, "rows": p.rows, "cols": p.cols,
                           "type": p.qtype.name} for p in shapes.products],
             "mixes": [[q.name for q in mix] for mix in shapes.mixes],
             "left_out": list(shapes.left_out)}  # fmt: skip
    ceiling = {k: v for k, v in dataclasses.asdict(ceilings).items()
               if k not in ("h2d_gbs", "d2d_gbs")}  # fmt: skip
    report = _common(seconds, {}, {"name": name, "type": "cpu", "threads": threads},
                     {**source, "shapes": shape}, ceiling, judged, flag_below)  # fmt: skip
    for row, j in zip(report["rows"], judged, strict=True):
        row["read_share"] = float(f"{j.row.nbytes / j.row.us / 1e3 / ceilings.read_gbs:.4g}")
    return report


def _common(seconds: float, versions: dict[str, Any], device: dict[str, Any],
            model: dict[str, Any], ceilings: dict[str, Any], judged: list[Any],
            flag_below: float) -> dict[str, Any]:  # fmt: skip
    """The report both devices write."""
    import importlib.metadata
    import platform

    import torch

    try:
        strata = importlib.metadata.version("strata")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        strata = "source tree"
    worst = min(judged, key=lambda j: j.share, default=None)
    return {
        "schema": 1,
        "seconds": round(seconds, 2),
        "versions": {"strata": strata, "torch": torch.__version__,
                     "python": platform.python_version(), **versions},  # fmt: skip
        "device": device,
        "model": model,
        "ceilings": ceilings,
        "flag_below": flag_below,
        "rows": [j.to_json() for j in judged],
        "flagged": [f"{j.row.phase} {j.row.kernel}" for j in judged if j.flagged],
        "slowest": f"{worst.row.phase} {worst.row.kernel}" if worst is not None else None,
    }


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
