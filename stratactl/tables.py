"""`stratactl tables select|list`: the kernel tuning table that fits this GPU stack.

`select` detects the GPU architecture and the installed ROCm (or CUDA) version and names the
table that matches exactly; else the nearest runtime version's table of the same architecture
(which the daemon uses, with a warning), or says that none fits and what that costs. Exit 0 on
an exact match, 3 otherwise (the daemon still runs, perhaps slower), 1 when a GPU is found but
its runtime version is not. A host without a GPU has nothing to select (the cpu engine's
kernels need no table): it says so, exit 0.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kernels.tuning import tables
from stratactl.client import fail, print_json

EXIT_NO_MATCH = 3
NOTHING_ON_A_CPU = ("no GPU: nothing to select on a CPU (the cpu engine's kernels need no"
                    " tuning table)")  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tables", help="kernel tuning tables: select the one for this GPU",
                              description=__doc__)
    sub = p.add_subparsers(dest="tables_verb", metavar="ACTION", required=True)
    s = sub.add_parser("select", help="detect arch and runtime version; name the matching table")
    s.add_argument("--root", type=Path, default=Path("/"),
                   help="file-system root to detect from (default /; tests use fake trees)")
    s.add_argument("--rocm-path", default=os.environ.get("ROCM_PATH"),
                   help="ROCm install (default $ROCM_PATH, else /opt/rocm)")
    s.add_argument("--cuda-path", default=os.environ.get("CUDA_HOME"),
                   help="CUDA install (default $CUDA_HOME, else /usr/local/cuda)")
    s.add_argument("--stack", metavar="ARCH-BACKEND-VERSION",
                   help="skip detection, e.g. gfx1100-rocm-7.2.0")
    _dirs(s)
    s.add_argument("--json", action="store_true", help="print the choice as JSON")
    lst = sub.add_parser("list", help="the tables that exist")
    _dirs(lst)


def _dirs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables-dir", type=Path, action="append", dest="tables_dirs",
                   metavar="DIR", help="look here (repeatable; default: "
                   f"{' then '.join(str(d) for d in tables.SEARCH_PATH)})")


def run(args: argparse.Namespace) -> int:
    dirs = tuple(args.tables_dirs) if args.tables_dirs else tables.SEARCH_PATH
    if args.tables_verb == "list":
        for path, _ in tables.available(dirs):
            print(path)
        return 0
    notes: tuple[str, ...] = ()
    if args.stack:
        stack = tables.parse_name(f"{args.stack}.json")
        if stack is None:
            return fail(f"--stack {args.stack!r}: expected ARCH-BACKEND-VERSION, e.g."
                        " gfx1100-rocm-7.2.0 or sm90-cuda-12.8")
        stacks: tuple[tables.Stack, ...] = (stack,)
    else:
        try:
            found = tables.detect(args.root, args.rocm_path, args.cuda_path,
                                  os.environ.get("HSA_OVERRIDE_GFX_VERSION"))
        except tables.TableError as e:
            return fail(str(e))
        stacks, notes = found.stacks, found.notes
    if not stacks:  # detect() found no GPU (one without its runtime raised TableError)
        if args.json:
            print_json({"stacks": [], "notes": list(notes), "message": NOTHING_ON_A_CPU})
        else:
            print(NOTHING_ON_A_CPU)
        return 0
    choices = [tables.select(s, dirs) for s in stacks]
    if args.json:
        print_json({
            "notes": list(notes),
            "choices": [{"stack": c.stack.key, "matched": c.matched, "exact": c.exact,
                         "reason": c.reason,
                         "path": str(c.path) if c.path else None, "message": c.message,
                         "others": [str(p) for p in c.others]} for c in choices],
        })
    else:
        for note in notes:
            print(f"detected: {note}")
        for c in choices:
            print(f"{'ok  ' if c.exact else 'warn'} {c.message}")
    return 0 if all(c.exact for c in choices) else EXIT_NO_MATCH
