"""`stratactl tune`: measure the offload engine's kernels on this GPU and write a tuning table.

Candidate launch settings of each kernel (fused MoE, expert fetch, decode attention, prefill
dequantization) run at a model's shapes; the fastest that reproduces the default's result is
kept. The table is named for this GPU stack (`<arch>-<backend>-<version>.json`), where
`stratactl tables select` and the daemon look for it; the daemon reads it at start. Its header
names the arch, runtime, Triton and torch versions and the device; each model shape tuned is a
bucket: tuning another model adds its bucket to the stack's table (the same shapes replace
theirs), keeping the header's measured mismatch cost and the A/B switch defaults. A host
without a GPU has nothing to tune (the cpu engine's kernels need no table): it says so, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kernels.tuning import tables
from stratactl.client import fail, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="measure the kernels on this GPU; write a tuning table",
                              description=__doc__)  # fmt: skip
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--model", type=Path, help="take the shapes from this model (GGUF/pack)")
    shapes.add_argument("--preset", default="a3b",
                        help="or from a synthetic preset's geometry (default a3b)")  # fmt: skip
    p.add_argument("--stack", metavar="ARCH-BACKEND-VERSION",
                   help="name the table for this stack instead of detecting it")  # fmt: skip
    p.add_argument("--out", type=Path, default=tables.STATE_DIR,
                   help=f"directory to write the table to (default {tables.STATE_DIR})")
    p.add_argument("--kernels", default="moe,fetch,attention,dequant,linear",
                   help="comma-separated subset to tune (the others keep their defaults)")
    p.add_argument("--quick", action="store_true", help="two settings per kernel (a smoke run)")
    p.add_argument("--json", action="store_true", help="print the table written as JSON")
    p.set_defaults(run=run)


NOTHING_ON_A_CPU = "no GPU: nothing to tune on a CPU (the cpu engine's kernels need no table)"


def _stack(args: argparse.Namespace) -> tables.Stack | str:
    if args.stack:
        named = tables.parse_name(f"{args.stack}.json")
        return named or f"--stack {args.stack!r}: expected ARCH-BACKEND-VERSION"
    from stratad.engine.offload.kernel_table import (
        this_stack,  # the daemon's choice, torch imported
    )

    found = this_stack()
    return found if not isinstance(found, str) else f"{found} (pass --stack to name one)"


def run(args: argparse.Namespace) -> int:
    from kernels.tuning.configs import TUNED

    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(wanted) - set(TUNED))
    if unknown:
        return fail(f"--kernels: cannot tune {', '.join(unknown)} (known: {', '.join(TUNED)})")
    if args.stack and tables.parse_name(f"{args.stack}.json") is None:
        return fail(f"--stack {args.stack!r}: expected ARCH-BACKEND-VERSION, e.g. sm90-cuda-12.8")
    import torch  # the measurement needs the GPU runtime; other verbs start without it

    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1" and args.stack:
        device = torch.device("cpu")  # the interpreter: for tests, not for a real table
    else:
        print(NOTHING_ON_A_CPU)
        return 0
    stack = _stack(args)
    if isinstance(stack, str):
        return fail(stack)
    from kernels.tuning.configs import configs_to_json
    from stratad.model.spec import ModelError
    from stratad.tuning.tuner import tune

    try:
        shapes = _shapes(args)
    except (ModelError, ValueError) as err:
        return fail(str(err))
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    say(f"tuning for {stack.key} at {shapes}")
    best, measured = tune(shapes, device, wanted, quick=args.quick, progress=say)
    bucket = {"shapes": shapes.__dict__, "kernels": configs_to_json(best),
              "measured_us": measured}  # fmt: skip
    path = args.out / stack.file_name
    table = _merged(path, stack, bucket, _header(torch, device, stack))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")
    except OSError as err:
        return fail(f"cannot write the table in {args.out}: {err}")
    if args.json:
        print_json({"path": str(path), **table})
    else:
        print(f"wrote {path}")
    return 0


def _shapes(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from stratad.engine.offload.kernel_table import Shapes

    if args.model is not None:
        from stratad.store.loader import load_model

        spec = load_model(args.model).spec
        if not spec.is_moe:
            raise ValueError(f"{args.model}: not a mixture-of-experts model: nothing to tune")
        return Shapes.of(spec)
    from stratad.model.synthetic.presets import get_preset

    p = get_preset(args.preset)
    if not p.is_moe:
        raise ValueError(f"preset {args.preset}: not a mixture-of-experts model")
    return Shapes(p.hidden, p.ffn, p.n_experts_used, p.n_heads, p.n_kv_heads, p.head_dim,
                  p.n_experts)  # fmt: skip


def _header(torch, device, stack: tables.Stack) -> dict[str, str]:  # type: ignore[no-untyped-def]
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    return {"arch": stack.arch, "backend": stack.backend, "runtime": stack.version,
            "triton": str(triton.__version__), "torch": str(torch.__version__),
            "device": name}  # fmt: skip


def _merged(path: Path, stack: tables.Stack, bucket: dict, header: dict) -> dict:  # type: ignore[type-arg]
    """The table to write: the existing one's other buckets, switches and measured mismatch
    cost kept (an unreadable one is replaced), this run's bucket and header."""
    from kernels.tuning import table_file

    try:
        old = table_file.read(path, stack.key) if path.exists() else None
    except table_file.TableFileError:
        old = None
    buckets = [bucket]
    if old is not None:
        if old.header.mismatch_cost:
            header = {**header, "mismatch_cost": old.header.mismatch_cost}
        buckets += [{"shapes": dict(b.shapes), "kernels": dict(b.kernels),
                     "measured_us": dict(b.measured_us)}
                    for b in old.buckets if dict(b.shapes) != bucket["shapes"]]  # fmt: skip
    table = {"key": stack.key, "header": header, "buckets": buckets}
    if old is not None and old.switches:
        table["switches"] = {n: {"value": s.value, "ab": dict(s.ab)}
                             for n, s in old.switches.items()}  # fmt: skip
    return table
