"""The fastest MoE launch settings of a `bench.gpu.moe_types` sweep, written into a tuning table.

    python -m bench.gpu.moe_pick --sweep gate_up.json down.json --base TABLE --out TABLE
                                 [--format 'q4_k_m(q6_k down)']

The sweeps time each launch alone (`moe_types --launch gate_up`, `--launch down`) for one or
more token counts. For each launch the setting with the lowest geometric mean, over the token
counts, of its time relative to the fastest at that count wins (a setting not timed at every
count is not a candidate). The base table (e.g. the shipped `kernels/tables/sm90-cuda-13.0.json`)
is copied with the picks set in its first bucket for the format's types: `kernels.moe@TYPE`
(gate/up's type) and `kernels.moe_down@TYPE` (down's), since each GGUF type's reader wants its
own launch; everything else stays. What was picked is printed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from bench.gpu.moe_types import FORMATS
from kernels.tuning.configs import configs_from_kernels


def candidates(sweep: dict[str, Any], fmt: str, launch: str) -> dict[str, dict[int, float]]:
    """{setting's tag: {tokens: us}} of one launch of one format."""
    out: dict[str, dict[int, float]] = {}
    for key, r in sweep.items():
        parts = key.split("/")
        if len(parts) != 5 or parts[0] != fmt or parts[4] != launch:
            continue
        out.setdefault(parts[3], {})[int(r["tokens"])] = float(r["us"])
    return out


def pick(timed: dict[str, dict[int, float]]) -> tuple[str, float]:
    """The tag with the lowest geometric mean of its times relative to each count's fastest,
    and that mean."""
    counts = set.union(*(set(v) for v in timed.values()))
    full = {tag: v for tag, v in timed.items() if set(v) == counts}
    if not full:
        raise SystemExit("no setting was timed at every token count")
    fastest = {t: min(v[t] for v in full.values()) for t in counts}

    def score(v: dict[int, float]) -> float:
        return math.exp(sum(math.log(v[t] / fastest[t]) for t in counts) / len(counts))

    tag = min(full, key=lambda k: score(full[k]))
    return tag, score(full[tag])


def settings(sweep: dict[str, Any], fmt: str, launch: str, tag: str) -> dict[str, Any]:
    for key, r in sweep.items():
        if key.startswith(f"{fmt}/") and key.endswith(f"/{tag}/{launch}"):
            return dict(r["config"])
    raise KeyError(tag)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", nargs="+", type=Path, required=True, help="moe_types JSON files")
    p.add_argument("--format", default="q4_k_m(q6_k down)", choices=list(FORMATS))
    p.add_argument("--base", type=Path, required=True, help="the table to start from")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    sweep: dict[str, Any] = {}
    for path in a.sweep:
        sweep.update(json.loads(path.read_text()))
    table = json.loads(a.base.read_text())
    kernels = table["buckets"][0]["kernels"]
    gate, _, down = FORMATS[a.format]
    for launch, name in (("gate_up", f"moe@{gate.name.lower()}"),
                         ("down", f"moe_down@{down.name.lower()}")):  # fmt: skip
        timed = candidates(sweep, a.format, launch)
        if not timed:
            raise SystemExit(f"the sweep has no {launch} times for {a.format}")
        tag, score = pick(timed)
        times = ", ".join(f"T={t}: {us:.1f} us" for t, us in sorted(timed[tag].items()))
        print(f"{name} ({launch}): {tag} ({times}; {score:.3f} x the fastest per count)")
        kernels[name] = settings(sweep, a.format, launch, tag)
    configs_from_kernels(kernels, str(a.out))  # refuses a setting the engine would refuse
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
