"""`stratactl check`: the pre-start check (systemd ExecStartPre, the container entrypoint).

Each check prints ok, warn or fail with what it found; the exit code is 1 when any check
fails, 0 otherwise. No weight is read: a GGUF's header gets the daemon's own checks (every
tensor inside the file, aligned and apart, its shape what the hyper-parameters make it; this
maps the file and imports torch), and for a MoE model the residency plan is computed dry with
the store's own planning code. `--after-restart` also asks the running daemon for its plan and
coverage and says whether the start landed short of the dry plan.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kernels.tuning import tables
from stratactl.check_pack import MANIFEST, check_pack, pack_dir, pack_header
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
from stratad.config import Config, ConfigError, load_config
from stratad.control.server import listener
from stratad.env import Env
from stratad.protocol import CoverageReply, CoverageRequest, PlanReply, PlanRequest

Status = Literal["ok", "warn", "fail"]
GiB = 1 << 30


@dataclass(frozen=True)
class Result:
    name: str
    status: Status
    detail: str


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    arch: str
    n_layers: int
    n_experts: int
    nbytes: int

    @property
    def moe(self) -> bool:
        return self.n_experts > 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check", help="pre-start check: config, model, plan, memory, GPU",
                              description=__doc__)
    p.add_argument("--after-restart", action="store_true",
                   help="also compare the running daemon's plan and coverage with the dry plan")
    p.add_argument("--verify", action="store_true",
                   help="also read every expert blob of the pack and check its checksum")
    p.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    add_socket_args(p)


# ---- the checks -------------------------------------------------------------------------


def check_config(args: argparse.Namespace) -> tuple[Config | None, Result]:
    try:
        env = Env.read()
        config = load_config(args.config, env)
    except (ConfigError, ValueError) as e:
        return None, Result("config", "fail", str(e))
    source = args.config or env.config or "/etc/strata/stratad.toml"
    if not Path(source).is_file():
        return config, Result("config", "ok", "no config file: defaults (and STRATA_* variables)")
    return config, Result("config", "ok", f"{source} parsed")


def read_model_info(path: Path) -> ModelInfo:
    if (path / MANIFEST).is_file():  # a pack (`stratactl pack`)
        return ModelInfo(path, *pack_header(path))
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        if not size:
            raise OSError(f"{path}: no *.safetensors files")
        arch = str((cfg.get("architectures") or [cfg.get("model_type", "?")])[0])
        return ModelInfo(path, arch, int(cfg.get("num_hidden_layers", 0)), n_experts, size)
    from stratad.store.loader import load_model  # the daemon's checks: nothing is read

    model = load_model(path)
    spec = model.spec
    return ModelInfo(path, str(model.metadata.get("general.architecture", spec.arch)),
                     spec.n_layers, spec.n_experts, path.stat().st_size)


def check_model(config: Config) -> tuple[ModelInfo | None, Result]:
    if config.model.path:
        path = Path(config.model.path)
    else:
        from stratad.model.default import default_model_path

        try:
            path = default_model_path()
        except FileNotFoundError as e:
            return None, Result("model", "fail", str(e))
    if not path.exists():
        return None, Result("model", "fail", f"{path}: no such file or directory (model.path)")
    if not os.access(path, os.R_OK):
        return None, Result("model", "fail", f"{path}: not readable by uid {os.getuid()}")
    try:
        info = read_model_info(path)
    except Exception as e:  # any reader error: the daemon would fail the same way
        return None, Result("model", "fail", f"{path}: cannot read its header: {e}")
    kind = f"MoE, {info.n_experts} experts per layer" if info.moe else "dense"
    return info, Result("model", "ok", f"{path.name}: {info.arch}, {info.n_layers} layers, {kind},"
                        f" {gib(info.nbytes)}")


def pack_result(config: Config, verify: bool) -> Result | None:
    pack = pack_dir(config)
    if pack is None:
        return None
    status, detail = check_pack(pack, verify)
    return Result("pack", status, detail)


def vram_free_all(config: Config, root: Path) -> list[int | None]:
    """Free VRAM of each GPU the engine runs on (`engine.gpus` when they split the layers,
    else the configured device): what the daemon reads before it allocates."""
    if len(config.engine.gpus) >= 2:
        return [vram_free(root, g) for g in config.engine.gpus]
    device = config.engine.device
    return [vram_free(root, int(device.split(":")[1]) if device.startswith("cuda:") else 0)]


def vram_free(root: Path, index: int) -> int | None:
    """Free VRAM of GPU `index`, from sysfs (AMD) or nvidia-smi; None if unknown."""
    cards = sorted((root / "sys/class/drm").glob("card*/device/mem_info_vram_total"))
    if cards and index < len(cards):
        try:
            total = int(cards[index].read_text())
            used = int((cards[index].parent / "mem_info_vram_used").read_text())
            return total - used
        except (OSError, ValueError):
            return None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,"
                                  "nounits"], capture_output=True, text=True, timeout=20).stdout
            return int(out.split()[index]) << 20
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None
    return None


def check_plan(config: Config, info: ModelInfo, root: Path) -> tuple[Any, Result]:
    if not info.moe:
        return None, Result("plan", "ok", "dense model: every weight is loaded, no residency plan")
    from stratad.control.store_view import dry_plan  # imports torch (store planning code)

    try:
        dry = dry_plan(config, info.path, vram_free_all(config, root))
    except Exception as e:
        return None, Result("plan", "fail", f"cannot compute the residency plan: {e}")
    p, c = dry.plan, dry.coverage
    state = "complete" if c.complete else f"INCOMPLETE: {c.in_file_only} read from the file"
    return dry, Result(
        "plan", "ok" if c.complete else "warn",
        f"plan {p.hash}: {p.vram.experts} experts in VRAM ({gib(p.vram.bytes)}),"
        f" {p.ram.experts} in RAM ({gib(p.ram.bytes)} of {gib(p.ram_budget_bytes)});"
        f" coverage {c.experts - c.in_file_only} of {c.experts}, {state}",
    )


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def check_memory(config: Config, info: ModelInfo, dry: Any) -> Result:
    m = meminfo()
    total, available = m["MemTotal"], m.get("MemAvailable", 0)
    if dry is None:
        need, what = info.nbytes, "the model"
    else:
        need = dry.plan.ram.bytes + dry.plan.headroom_bytes
        what = "the resident set plus store.resident_headroom_gib"
    host = f"MemTotal {gib(total)}, MemAvailable {gib(available)}"
    if need > total:
        return Result("memory", "fail", f"{what} needs {gib(need)}; {host}")
    if need > available:
        policy = config.store
        return Result("memory", "warn", f"{what} needs {gib(need)}, more than is available now"
                      f" ({host}): the daemon waits up to {policy.admission_wait_s:.0f} s, then"
                      f" {'refuses to start' if policy.on_short_ram == 'refuse' else 'degrades'}")
    return Result("memory", "ok", f"{what} needs {gib(need)}; {host}")


def check_memlock(config: Config, dry: Any, gpu: bool) -> Result:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else gib(soft)
    need = 0 if dry is None or config.store.lock == "none" else dry.plan.ram.bytes
    if soft == resource.RLIM_INFINITY or need <= soft:
        return Result("memlock", "ok", f"RLIMIT_MEMLOCK {limit}"
                      + (f", the resident set needs {gib(need)}" if need else ""))
    hint = ("LimitMEMLOCK=infinity in the unit, --ulimit memlock=-1 for docker,"
            " lxc.prlimit.memlock=unlimited for LXC")
    uses_mlock = config.store.lock == "mlock" or (config.store.lock == "auto" and not gpu)
    return Result("memlock", "fail" if uses_mlock else "warn",
                  f"RLIMIT_MEMLOCK {limit} < the resident set's {gib(need)}: {hint}")


def gpu_devices(root: Path) -> tuple[list[Path], list[Path]]:
    """(AMD nodes, NVIDIA nodes) present under root/dev."""
    dev = root / "dev"
    amd = [p for p in [dev / "kfd", *sorted((dev / "dri").glob("renderD*"))] if p.exists()]
    nvidia = [p for p in [dev / "nvidiactl", *sorted(dev.glob("nvidia[0-9]*"))] if p.exists()]
    if not (dev / "kfd").exists():
        amd = []
    return amd, nvidia


def check_gpu(config: Config, root: Path) -> tuple[bool, Result]:
    amd, nvidia = gpu_devices(root)
    nodes = amd or nvidia
    device = config.engine.device
    if device == "cpu":
        return False, Result("gpu", "ok", "engine.device = cpu: no GPU needed")
    if not nodes:
        status: Status = "fail" if device.startswith("cuda") else "warn"
        outcome = "cannot start" if status == "fail" else "runs on the CPU"
        return False, Result("gpu", status, f"no GPU device nodes ({root / 'dev'}/kfd, nvidia*):"
                             f" engine.device = {device} {outcome}")
    denied = [str(p) for p in nodes if not os.access(p, os.R_OK | os.W_OK)]
    if denied:
        return False, Result("gpu", "fail", f"no read/write access to {', '.join(denied)} for uid"
                             f" {os.getuid()}: add the user to the render and video groups")
    kind = "AMD (ROCm)" if amd else "NVIDIA (CUDA)"
    return True, Result("gpu", "ok", f"{kind}: {', '.join(str(p) for p in nodes)}")


def check_tables(root: Path, gpu: bool) -> Result:
    if not gpu:
        return Result("tables", "ok", "no GPU: no kernel tuning table needed")
    try:
        found = tables.detect(root, os.environ.get("ROCM_PATH"), os.environ.get("CUDA_HOME"),
                              os.environ.get("HSA_OVERRIDE_GFX_VERSION"))
    except tables.TableError as e:
        return Result("tables", "warn", str(e))
    if not found.stacks:
        return Result("tables", "warn", "; ".join(found.notes))
    choices = [tables.select(s) for s in found.stacks]
    return Result("tables", "ok" if all(c.exact for c in choices) else "warn",
                  " | ".join(c.message for c in choices))


def check_socket(config: Config, after_restart: bool) -> Result:
    """Whether the daemon can set up its control socket: no live daemon holds the path (one
    that does is the daemon just restarted with `--after-restart`; before a start it would make
    the new one refuse to start) and its directory is writable."""
    if not config.control.socket:
        return Result("socket", "ok", "control.socket is empty: no control socket")
    path = Path(config.control.socket)
    if path.is_socket():
        holder = listener(path)
        if holder is not None and after_restart:
            return Result("socket", "ok", f"{path}: the running daemon's (pid {holder.pid})")
        if holder is not None:
            return Result("socket", "fail", f"{path}: held by a live daemon (pid {holder.pid}):"
                          " a second stratad refuses to start on it; stop that one, or give"
                          " this one another control.socket")  # fmt: skip
        stale = "; a stale socket file there (its daemon is gone), which the daemon replaces"
    else:
        stale = ""
    d = path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    if os.access(d, os.W_OK | os.X_OK):
        return Result("socket", "ok", f"{path}: {d} is writable{stale}")
    return Result("socket", "warn", f"{path}: {d} is not writable for uid {os.getuid()}: the"
                  " daemon runs without a control socket (systemd: RuntimeDirectory=strata)")


def check_port(config: Config) -> Result:
    host, port = config.server.host, config.server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return Result("port", "fail", f"{host}:{port}: {e.strerror} (server.host/server.port)")
    return Result("port", "ok", f"{host}:{port} is free")


def check_running(args: argparse.Namespace, config: Config, dry: Any) -> list[Result]:
    client = Client(socket_path(args))
    try:
        plan = client.request(PlanRequest(), PlanReply)
        cov = client.request(CoverageRequest(), CoverageReply)
    except (ClientError, DaemonError) as e:
        return [Result("restart", "fail", f"cannot ask the running daemon: {e}")]
    if not plan.moe:
        return [Result("restart", "ok", "the daemon serves a dense model: nothing can land short")]
    covered = cov.experts - cov.in_file_only
    running = f"running plan {plan.hash}: coverage {covered} of {cov.experts}"
    if plan.degraded:
        return [Result("restart", "fail", f"landed SHORT: {running}, DEGRADED (not enough RAM at"
                       f" start); {cov.estimated_cost}")]
    if dry is None:
        return [Result("restart", "warn", f"{running}; no dry plan to compare with")]
    dry_covered = dry.coverage.experts - dry.coverage.in_file_only
    if plan.hash == dry.plan.hash:
        return [Result("restart", "ok", f"landed as planned: {running}")]
    if covered < dry_covered:
        return [Result("restart", "fail", f"landed SHORT: {running}, the dry plan {dry.plan.hash}"
                       f" covers {dry_covered}; {cov.estimated_cost}")]
    return [Result("restart", "warn", f"{running} differs from the dry plan {dry.plan.hash}"
                   f" ({dry_covered} covered), but covers no less")]


# ---- the verb ---------------------------------------------------------------------------


def run_checks(args: argparse.Namespace) -> tuple[list[Result], Any]:
    config, result = check_config(args)
    results = [result]
    if config is None:
        return results, None
    info, result = check_model(config)
    results.append(result)
    pack = pack_result(config, getattr(args, "verify", False))
    if pack is not None:
        results.append(pack)
    gpu, gpu_result = check_gpu(config, args.root)
    dry = None
    if info is not None and (pack is None or pack.status != "fail"):
        dry, result = check_plan(config, info, args.root)
        results.append(result)
        results.append(check_memory(config, info, dry))
    results.append(check_memlock(config, dry, gpu))
    results.append(gpu_result)
    results.append(check_tables(args.root, gpu))
    results.append(check_socket(config, args.after_restart))
    if args.after_restart:
        results.extend(check_running(args, config, dry))
    else:
        results.append(check_port(config))
    return results, dry


def run(args: argparse.Namespace) -> int:
    try:
        results, dry = run_checks(args)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # a check that crashed is a failed check, not a traceback
        return fail(f"check: {type(e).__name__}: {e}")
    failed = any(r.status == "fail" for r in results)
    if args.json:
        print_json({"ok": not failed, "checks": [asdict(r) for r in results],
                    "plan": dry.plan if dry is not None else None})
    else:
        for r in results:
            print(f"{r.status:<5} {r.name:<8} {r.detail}")
    return 1 if failed else 0
