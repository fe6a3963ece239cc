"""A/B/A a kernel path's switch on this machine and record the verdict as the architecture's
default in a tuning table (`kernels.tuning.ab` decides, `kernels.tuning.table_file` holds it).

Each arm is a command with `{value}` (the switch's setting) and `{json}` (a file the command
writes its figures to) in it; `--metric` names the figure (a list of repeats counts as its
median). E.g. on the GPU machine:

    python -m bench.gpu.ab_switch --table kernels/tables/sm90-cuda-13.0.json --switch gpu_miss \\
        --values copy,in_place --kind decode --metric decode_tps --rounds 3 \\
        --cmd 'python -m bench.gpu.e2e --model a3b.gguf --gpu-miss {value} --json {json}'

The first value is A (today's default); the table's `switches.<name>` gets B only when B is
really better. Without `--table` the verdict is printed and nothing is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernels.tuning import ab


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.ab_switch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", required=True, help="the switch's name in the table")
    p.add_argument("--values", required=True, help="A,B: the default first")
    p.add_argument("--cmd", required=True, help="command per sample, with {value} and {json}")
    p.add_argument("--metric", required=True, help="the figure in the command's JSON")
    p.add_argument("--kind", default="decode", choices=sorted(ab.NOISE_FLOOR),
                   help="what is measured: sets the noise floor (default decode)")
    p.add_argument("--lower-is-better", action="store_true", help="the metric is a time")
    p.add_argument("--rounds", type=int, default=3, help="samples of B (A gets one more)")
    p.add_argument("--table", type=Path, help="the tuning table to record the default in")
    return p


def _measure(cmd: str, value: str, metric: str) -> Callable[[], float]:
    def run() -> float:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "figures.json"
            line = cmd.replace("{value}", shlex.quote(value)).replace("{json}", str(out))
            subprocess.run(line, shell=True, check=True, stdout=sys.stderr)
            figure = json.loads(out.read_text())[metric]
            # a list (one figure per repeat, as bench.gpu.e2e's decode_tps) counts as its median
            return float(statistics.median(figure) if isinstance(figure, list) else figure)

    return run


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    values = args.values.split(",")
    if len(values) != 2 or values[0] == values[1]:
        print("--values: two different settings, A,B", file=sys.stderr)
        return 2
    a, b = values
    verdict = ab.run_ab((a, _measure(args.cmd, a, args.metric)),
                        (b, _measure(args.cmd, b, args.metric)), args.rounds, args.kind,
                        not args.lower_is_better,
                        progress=lambda line: print(line, file=sys.stderr))  # fmt: skip
    print(f"{args.switch}: {verdict.summary()}")
    if args.table is not None:
        entry = ab.record(verdict, {a: a, b: b})
        entry["command"] = args.cmd  # what each sample ran, with {value} for the arm
        entry["date"] = datetime.date.today().isoformat()
        table: dict[str, Any] = json.loads(args.table.read_text())
        table.setdefault("switches", {})[args.switch] = entry
        args.table.write_text(json.dumps(table, indent=1) + "\n")
        print(f"{args.table}: switches.{args.switch} = {entry['value']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
