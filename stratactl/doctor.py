"""`stratactl doctor`: everything a bug report needs, in one command, with or without a daemon.

GPU (name, arch, driver and runtime versions), torch and Triton versions, the kernel tuning
table in use and why, the memlock limit, host RAM and its measured read bandwidth, the plan
hash and coverage from the control socket when a daemon answers, the STRATA_* and GPU-stack
environment variables set, and the last WARNING lines of the daemon's log (the journal, or
`--log FILE`). `--json` for a bug report. Each part that cannot be read says why; the command
exits 0 unless its own arguments are wrong.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import resource
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratactl.client import (
    Client,
    ClientError,
    DaemonError,
    add_socket_args,
    fail,
    gib,
    print_json,
    socket_path,
)

# variables of the GPU stack that change what the runtime does (besides STRATA_*)
GPU_PREFIXES = ("HSA_", "HIP_", "ROCR_", "ROCM_", "CUDA_", "NVIDIA_", "TRITON_", "PYTORCH_",
                "AMD_", "GPU_", "HCC_", "MIOPEN_")  # fmt: skip
Report = dict[str, Any]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="everything a bug report needs, in one command",
                              description=__doc__)  # fmt: skip
    p.add_argument("--log", type=Path, help="the daemon's log file (default: the journal)")
    p.add_argument("--unit", default="stratad.service", help="systemd unit (default stratad)")
    p.add_argument("--warnings", type=int, default=20, metavar="N",
                   help="how many of the last WARNING lines to show (default 20)")
    add_socket_args(p)


def run(args: argparse.Namespace) -> int:
    if args.warnings < 0:
        return fail("--warnings: a count of lines, 0 or more")
    report = collect(args)
    if args.json:
        print_json(report)
    else:
        print(render(report))
    return 0


def collect(args: argparse.Namespace) -> Report:
    parts: dict[str, Callable[[], Any]] = {
        "host": _host,
        "versions": _versions,
        "gpu": _gpu,
        "tables": _tables,
        "memlock": _memlock,
        "ram": _ram,
        "cpu_kernels": _cpu_kernels,
        "daemon": lambda: _daemon(args),
        "environment": _environment,
        "log": lambda: _log(args),
    }
    report: Report = {}
    for name, part in parts.items():
        try:
            report[name] = part()
        except Exception as err:  # one unreadable part never hides the others
            report[name] = {"error": f"{type(err).__name__}: {err}"}
    return report


def _host() -> Report:
    return {"os": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}  # fmt: skip


def _versions() -> Report:
    out: Report = {}
    for dist in ("strata", "torch", "triton", "pytorch-triton-rocm", "numpy", "gguf"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _gpu() -> Report:
    import torch  # the runtime's own view; the other verbs start without it

    runtime = f"ROCm {torch.version.hip}" if torch.version.hip else (
        f"CUDA {torch.version.cuda}" if torch.version.cuda else "none (a CPU build of torch)")
    if not torch.cuda.is_available():
        return {"gpus": [], "runtime": runtime, "summary": "no GPU"}
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        if torch.version.hip:
            arch = props.gcnArchName.split(":")[0]
        else:
            arch = f"sm{props.major}{props.minor}"
        gpus.append({"index": i, "name": props.name, "arch": arch,
                     "memory_bytes": props.total_memory})  # fmt: skip
    return {"gpus": gpus, "runtime": runtime, "driver": _driver(bool(torch.version.hip)),
            "summary": ", ".join(f"{g['name']} ({g['arch']})" for g in gpus)}  # fmt: skip


def _driver(amd: bool) -> str | None:
    if amd:
        try:
            return "amdgpu " + Path("/sys/module/amdgpu/version").read_text().strip()
        except OSError:
            return None
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.split()
    return f"NVIDIA {out[0]}" if out else None


def _tables() -> Report:
    import torch

    from stratad.engine.offload.kernel_table import lookup, this_stack

    if not torch.cuda.is_available():
        return {"stack": None, "path": None, "reason": "no-gpu",
                "message": "no GPU: the kernels run on the CPU with the interpreter's settings"}
    stack = this_stack()
    if isinstance(stack, str):
        return {"stack": None, "path": None, "reason": "no-stack", "message": stack}
    found = lookup(stack)
    choice = found.choice
    return {"stack": stack.key, "path": str(choice.path) if choice and choice.path else None,
            "reason": choice.reason if choice else "refused", "message": found.message,
            "switches": dict(found.switches)}  # fmt: skip


def _memlock() -> Report:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def text(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else gib(n)

    return {"soft_bytes": None if soft == resource.RLIM_INFINITY else soft,
            "hard_bytes": None if hard == resource.RLIM_INFINITY else hard,
            "summary": f"soft {text(soft)}, hard {text(hard)}"}  # fmt: skip


def _ram() -> Report:
    import psutil

    from stratad.store.placement.hostmem import cores, read_bps  # numpy: loaded only here

    mem = psutil.virtual_memory()
    return {"total_bytes": mem.total, "available_bytes": mem.available,
            "read_gbs": round(read_bps() / 1e9, 2), "read_threads": cores()}  # fmt: skip


def _cpu_kernels() -> Report:
    """Whether the C compiler builds the CPU kernels (the cpu engine and the CPU's share of a
    GPU step's misses), and where the library is cached."""
    from kernels.cpu import build as cpu_build

    try:
        return {"library": str(cpu_build.build()), "compiler": " ".join(cpu_build.compiler())}
    except cpu_build.CpuKernelsUnavailable as err:
        return {"error": str(err)}


def _daemon(args: argparse.Namespace) -> Report:
    from stratad.protocol import CoverageReply, CoverageRequest, StatusReply, StatusRequest

    path = socket_path(args)
    client = Client(path, timeout_s=5.0)
    try:
        status = client.request(StatusRequest(), StatusReply)
        coverage = client.request(CoverageRequest(), CoverageReply)
    except (ClientError, DaemonError) as err:
        return {"socket": str(path), "running": False, "summary": str(err)}
    return {"socket": str(path), "running": True, "state": status.state,
            "version": status.version, "model": status.model, "device": status.device,
            "plan_hash": status.plan_hash,
            "coverage": {"complete": coverage.complete, "experts": coverage.experts,
                         "in_vram": coverage.in_vram, "in_ram": coverage.in_ram,
                         "in_file_only": coverage.in_file_only,
                         "routed_mass": coverage.routed_mass},
            "summary": f"{status.state}, {status.model} on {status.device}, plan"
                       f" {status.plan_hash or '-'}, coverage "
                       + ("complete" if coverage.complete else
                          f"{coverage.in_vram + coverage.in_ram} of {coverage.experts}"
                          " experts held")}  # fmt: skip


def _environment() -> Report:
    from stratad.env import Env

    known = {name for name, _ in Env.documented()}
    strata = {k: v for k, v in sorted(os.environ.items()) if k.startswith("STRATA_")}
    Env.read()  # a value of the wrong type is an error worth reporting
    return {"strata": strata, "unknown_strata": sorted(set(strata) - known),
            "gpu_stack": {k: v for k, v in sorted(os.environ.items())
                          if k.startswith(GPU_PREFIXES)}}  # fmt: skip


def _log(args: argparse.Namespace) -> Report:
    """The last WARNING (and worse) lines: from --log, else the journal (journalctl)."""
    if args.log is not None:
        from stratactl.logs import read_file

        with open(args.log, errors="replace") as stream:
            lines = [e.render() for e in read_file(stream) if e.level >= 30]
        return {"source": str(args.log), "warnings": lines[-args.warnings:] if args.warnings
                else []}  # fmt: skip
    from stratactl.logs import NO_JOURNAL, journal_present

    if not journal_present():
        return {"source": None, "warnings": [],
                "summary": f"{NO_JOURNAL}; pass that log with --log FILE"}
    if shutil.which("journalctl") is None:
        return {"source": None, "warnings": [], "summary": "a journal but no journalctl to read"
                " it on this host: pass the daemon's log with --log FILE"}  # fmt: skip
    r = subprocess.run(["journalctl", "-u", args.unit, "-p", "warning", "-n", str(args.warnings),
                        "--no-pager", "-o", "short-iso", "-q"],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    return {"source": f"journalctl -u {args.unit}", "warnings": lines[-args.warnings:]
            if args.warnings else [], **({"summary": r.stderr.strip()} if r.returncode else {})}


def render(report: Report) -> str:
    def get(part: str, key: str, default: str = "-") -> Any:
        value = report.get(part, {})
        if "error" in value:
            return f"cannot tell ({value['error']})"
        return value.get(key, default)

    versions = report.get("versions", {})
    ram = report.get("ram", {})
    cpu = report.get("cpu_kernels", {})
    env = report.get("environment", {})
    rows = [
        ("host", f"{get('host', 'os')}, Python {get('host', 'python')},"
                 f" {get('host', 'cpus')} CPUs"),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items()
                               if k != "error") or get("versions", "x")),
        ("gpu", f"{get('gpu', 'summary')}; runtime {get('gpu', 'runtime')}; driver"
                f" {get('gpu', 'driver') or '-'}"),
        ("table", f"{get('tables', 'message')}"),
        ("memlock", get("memlock", "summary")),
        ("ram", f"{gib(ram.get('total_bytes'))} total, {gib(ram.get('available_bytes'))}"
                f" available, read {ram.get('read_gbs', '-')} GB/s"
                f" ({ram.get('read_threads', '-')} threads)" if "error" not in ram
         else get("ram", "x")),
        ("cpu kern", f"built by {cpu.get('compiler')}: {cpu.get('library')}" if "error" not in cpu
                     else f"unavailable: {cpu['error']} (the reference serves CPU hosts)"),
        ("daemon", get("daemon", "summary")),
        ("env", " ".join(f"{k}={v}" for k, v in {**env.get("strata", {}),
                                                 **env.get("gpu_stack", {})}.items())
         or ("none set" if "error" not in env else get("environment", "x"))),
    ]
    if env.get("unknown_strata"):
        rows.append(("env", "not read by stratad (a typo?): " + ", ".join(env["unknown_strata"])))
    log = report.get("log", {})
    source = f" from {log['source']}" if log.get("source") else ""
    rows.append(("log", f"last WARNING lines{source}" if "error" not in log
                 else get("log", "x")))  # fmt: skip
    text = "\n".join(f"{name:<9} {value}" for name, value in rows)
    # under the heading: the lines and what the reader said, never nothing
    under = [*log.get("warnings", []), *([log["summary"]] if log.get("summary") else [])]
    if not under and "error" not in log:
        under = ["no WARNING line"]
    return "\n".join([text, *(f"  {line}" for line in under)])
