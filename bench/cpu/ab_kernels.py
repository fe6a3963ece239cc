"""The CPU kernels of several revisions side by side in one process: which is faster, and do
they give the same bits.

    python -m bench.cpu.ab_kernels REV [REV ...] [--shape smollm2|llama1b] [--qtype T]
                                   [--layers 30] [--cases 1400:1,1400:9,0:512] [--rounds 7]
                                   [--threads N] [--json PATH]

Each REV's `kernels/cpu` sources (`git archive REV`; `.` for the working tree) are built and
loaded together, then timed in turns within each round: dense layers in one call
(`kernels/cpu/dense.py`) at SmolLM2-135M's shapes with random Q4_1 weights (`--shape llama1b`:
a 1B llama's, Q4_K; `--qtype` another type the kernels read), for each case
KEYS:TOKENS, that is TOKENS new tokens of one sequence after KEYS cached ones (1400:1 a decode
step at 1,400 keys, 1400:9 a verify of 8 drafted tokens, 0:512 a prompt chunk). Prints the
median ms per call (min–max) of each revision, its ratio to the first, and whether every
revision's hidden states and cache rows are the first's bits.

Why in one process: a shared VM's speed moves 20-40% within an hour, so timing one process
after another mixes the hour into the code's effect; turns within one process do not. The
revisions must share the C functions' signatures (those `kernels/cpu/experts.py` calls): this
compares changes inside the kernels.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu.build import SOURCE_DIR
from kernels.cpu.dense import (
    CACHE_DTYPE,
    PROJECTIONS,
    CacheSpan,
    DenseLayer,
    DenseShape,
    DenseStack,
)
from kernels.cpu.experts import CpuExperts, physical_cores
from kernels.formats.quant import QType, quantize
from stratad.engine.reference.layers import rope_tables
from stratad.model.spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]
SHAPES = {  # a shape and the type its weights are timed in unless --qtype says
    "smollm2": (DenseShape(hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn=1536,
                           rope_interleaved=False, eps=1e-5), QType.Q4_1),
    "llama1b": (DenseShape(hidden=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192,
                           rope_interleaved=False, eps=1e-5), QType.Q4_K),
}  # fmt: skip
MIN_TIMING_S = 0.05  # calls repeated until one timing lasts this long


def sources(rev: str, work: Path) -> Path:
    """The folder of `rev`'s CPU kernel sources: this tree's for ".", else extracted from git."""
    if rev == ".":
        return SOURCE_DIR
    done = subprocess.run(["git", "archive", "--format=tar", rev, "kernels/cpu"], cwd=REPO,
                          capture_output=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"git archive {rev}: {done.stderr.decode(errors='replace').strip()}")
    into = work / rev.replace("/", "_")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "kernels" / "cpu"


def random_layers(shape: DenseShape, n: int, qtype: QType, seed: int = 0) -> list[DenseLayer]:
    """n layers of random weights in qtype (unit norms, no biases)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        weights = tuple(
            (quantize(torch.randn(*shape.rows_cols()[p], generator=gen) * 0.02, qtype), qtype)
            for p in PROJECTIONS
        )  # fmt: skip
        ones = torch.ones(shape.hidden)
        out.append(DenseLayer(ones, ones.clone(), weights, (None, None, None)))
    return out


@dataclass
class Case:
    """TOKENS new tokens of one sequence after KEYS cached: its inputs, per revision its own
    caches (each call writes the new tokens' rows)."""

    keys: int
    tokens: int
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    caches: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]

    @property
    def name(self) -> str:
        return f"{self.keys}:{self.tokens}"

    @classmethod
    def make(cls, keys: int, tokens: int, shape: DenseShape, layers: int,
             revs: Sequence[str]) -> Case:  # fmt: skip
        gen = torch.Generator().manual_seed(keys * 7919 + tokens)
        rows = (keys + tokens, shape.n_kv_heads, shape.head_dim)
        k = [torch.randn(*rows, generator=gen).to(CACHE_DTYPE) for _ in range(layers)]
        v = [torch.randn(*rows, generator=gen).to(CACHE_DTYPE) for _ in range(layers)]
        spec = ModelSpec(arch="llama", n_layers=layers, hidden=shape.hidden,
                         n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
                         head_dim=shape.head_dim, vocab_size=32, rms_eps=shape.eps,
                         rope_theta=10_000.0, context_length=keys + tokens)  # fmt: skip
        cos, sin = rope_tables(spec, torch.arange(keys, keys + tokens), torch.device("cpu"))
        x = torch.randn(tokens, shape.hidden, generator=gen)
        caches = {r: ([c.clone() for c in k], [c.clone() for c in v]) for r in revs}
        return cls(keys, tokens, x, cos.contiguous(), sin.contiguous(), caches)

    def run(self, stack: DenseStack, rev: str) -> torch.Tensor:
        y = self.x.clone()
        k, v = self.caches[rev]
        stack(y, [CacheSpan(k, v, self.keys, self.tokens)], self.cos, self.sin)
        return y


def _timing(case: Case, stack: DenseStack, rev: str, reps: int) -> float:
    """Seconds per call of `reps` calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        case.run(stack, rev)
    return (time.perf_counter() - t0) / reps


def compare(revs: Sequence[str], cases: Sequence[tuple[int, int]], layers: int, rounds: int,
            threads: int, shape: DenseShape, qtype: QType) -> dict[str, object]:  # fmt: skip
    """Each case's ms per call per revision (a sample per round) and whether the bits agree."""
    with tempfile.TemporaryDirectory() as tmp:
        stacks = {}
        weights = random_layers(shape, layers, qtype)
        for rev in revs:
            cpu = CpuExperts(threads, source=sources(rev, Path(tmp)))
            stacks[rev] = DenseStack(cpu, shape, weights)
    timed: dict[str, dict[str, object]] = {}
    for keys, tokens in cases:
        case = Case.make(keys, tokens, shape, layers, revs)
        outs = {r: case.run(stacks[r], r) for r in revs}  # the first call: builds and warms
        reps = max(1, round(MIN_TIMING_S / _timing(case, stacks[revs[0]], revs[0], 1)))
        ms: dict[str, list[float]] = {r: [] for r in revs}
        for i in range(rounds):
            for r in revs if i % 2 == 0 else revs[::-1]:
                ms[r].append(1e3 * _timing(case, stacks[r], r, reps))
        first = revs[0]
        same = all(torch.equal(outs[r], outs[first])
                   and all(torch.equal(a, b) for a, b in zip(
                       case.caches[r][0] + case.caches[r][1],
                       case.caches[first][0] + case.caches[first][1], strict=True))
                   for r in revs)  # fmt: skip
        timed[case.name] = {"ms": ms, "same_bits": same}
    return {"revisions": list(revs), "layers": layers, "rounds": rounds, "threads": threads,
            "cases": timed}  # fmt: skip


def table(result: dict[str, object]) -> str:
    revs = result["revisions"]
    assert isinstance(revs, list)
    lines = ["| keys:tokens | " + " | ".join(f"{r} ms" for r in revs) + " | "
             + " | ".join(f"{revs[0]} / {r}" for r in revs[1:]) + " | same bits |",
             "| --- |" + " ---: |" * (2 * len(revs) - 1) + " --- |"]  # fmt: skip
    cases = result["cases"]
    assert isinstance(cases, dict)
    for name, c in cases.items():
        med = {r: statistics.median(c["ms"][r]) for r in revs}
        cells = " | ".join(f"{med[r]:.2f} ({min(c['ms'][r]):.2f}–{max(c['ms'][r]):.2f})"
                           for r in revs)  # fmt: skip
        ratios = " | ".join(f"{med[revs[0]] / med[r]:.2f}x" for r in revs[1:])
        lines.append(f"| {name} | {cells} | {ratios} | {'yes' if c['same_bits'] else 'NO'} |")
    return "\n".join(lines)


def _qtype(name: str) -> QType:
    try:
        return QType.__members__[name.upper()]
    except KeyError:
        raise ValueError(name) from None


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu.ab_kernels", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("revs", nargs="+", help='git revisions, "." for the working tree')
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--qtype", type=_qtype, help="Q4_0, Q4_1, Q8_0, Q4_K, ...")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--cases", default="1400:1,1400:9,0:512", help="KEYS:TOKENS,...")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=physical_cores())
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        cases = [(int(k), int(t)) for k, t in (c.split(":") for c in args.cases.split(","))]
    except ValueError:
        p.error(f"--cases {args.cases!r}: KEYS:TOKENS pairs, comma-separated")
    if any(k < 0 or t < 1 for k, t in cases) or args.layers < 1 or args.rounds < 1:
        p.error("keys >= 0, tokens >= 1, --layers >= 1 and --rounds >= 1")
    torch.set_num_threads(1)
    shape, qtype = SHAPES[args.shape]
    qtype = args.qtype or qtype
    result = compare(args.revs, cases, args.layers, args.rounds, args.threads, shape, qtype)
    result.update(shape=args.shape, qtype=qtype.name)
    print(f"{args.layers} layers at {args.shape}'s shapes, {qtype.name}, {args.threads} threads;"
          f" median of {args.rounds} rounds in turns (min–max)")  # fmt: skip
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
