"""`stratactl synth PRESET -o FILE.gguf`: write a random-weight model with a real geometry.

The model code (and torch) is imported inside `run`, so that other verbs start fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TextIO

# Below this much tensor data the file is written in seconds: no progress line.
PROGRESS_MIN_BYTES = 256 << 20

# `stratad.model.synthetic.ftype_rules.FTYPES`, named here so that building the parser
# imports neither gguf nor numpy (every stratactl verb builds it); a test keeps the two the same.
FTYPE_NAMES = ("q4_0", "q8_0", "q2_k", "q3_k_m", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
               "iq3_s", "iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "mxfp4_moe")
PRESET_TYPES = "preset"
# `stratad.model.synthetic.presets.PRESETS`, likewise named here (a test keeps them the same)
PRESET_NAMES = ("tiny-moe", "tiny-dense", "tiny-glm", "tiny-gpt-oss", "tiny-qwen3-next",
                "tiny-deepseek", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air",
                "qwen3-next-80b-a3b", "deepseek-v2-lite", "a3b")  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "synth",
        help="write a deterministic random-weight GGUF model with a real model's geometry",
        description=(
            "Write a GGUF model with random weights, a real architecture's geometry and"
            " SmolLM2's tokenizer; llama.cpp and stratad load it. Same preset and seed give"
            " the same bytes. Presets: the tiny-* ones (a few tens of MB, for tests: each"
            " architecture's layout), and real geometries: a3b (Qwen3-30B-A3B's, about 17.5 GB,"
            " a few minutes), gpt-oss-20b, gpt-oss-120b, glm-4.5-air, qwen3-next-80b-a3b,"
            " deepseek-v2-lite (written in --ftype's types, as their published GGUFs are)."
        ),
    )
    p.add_argument("preset", metavar="PRESET", help=", ".join(PRESET_NAMES))
    p.add_argument("-o", "--output", type=Path, required=True, help="the .gguf file to write")
    p.add_argument(
        "--ftype", default=PRESET_TYPES, type=str.lower, choices=(PRESET_TYPES, *FTYPE_NAMES),
        metavar="FTYPE",
        help=(
            "store the tensors in the types llama.cpp's llama-quantize would choose for this"
            f" file type and geometry: {', '.join(FTYPE_NAMES)}. Quantized tensors are"
            " random valid blocks with the preset's weight spread. Default: preset, each"
            " preset's own fixed types (a3b: Q4_0 experts, Q8_0 the rest, F32 norms and router)"
        ),
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16),
                   help="processes generating tensor slices (default: the CPU count, at most 16)")
    p.set_defaults(run=run)
    return p


class ProgressLine:
    """Bytes written / total, rate and ETA on stderr: redrawn in place every second on a
    terminal, one line every ten seconds into a log."""

    def __init__(self, label: str, stream: TextIO = sys.stderr):
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.interval_s = 1.0 if self.tty else 10.0
        self.start: float | None = None  # the first slice, not the tokenizer read, starts it
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = self.last = now
            return
        if now - self.last < self.interval_s and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = (total - done) / rate
        line = (
            f"{self.label}: {_gb(done)} / {_gb(total)} GB ({100 * done / total:.0f}%),"
            f" {rate / 1e6:.0f} MB/s, ETA {_duration(eta)}"
        )
        end = "" if self.tty and done < total else "\n"
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def _duration(s: float) -> str:
    m, sec = divmod(int(s + 0.5), 60)
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def run(args: argparse.Namespace) -> int:
    from stratad.model.synthetic import writer as synth

    try:
        preset = synth.get_preset(args.preset)
        ftype = None if args.ftype == PRESET_TYPES else synth.get_ftype(args.ftype)
    except (synth.UnknownPreset, synth.UnknownFtype) as e:
        print(f"stratactl synth: {e}", file=sys.stderr)
        return 2
    out: Path = args.output
    if out.exists() and not args.force:
        print(f"stratactl synth: {out} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    if out.is_dir():
        print(f"stratactl synth: {out} is a directory", file=sys.stderr)
        return 1
    total = synth.data_nbytes(preset, ftype)
    label = f"synth {preset.name}" + (f" {ftype.name}" if ftype else "")
    progress = ProgressLine(label) if total >= PROGRESS_MIN_BYTES else None
    start = time.monotonic()
    try:
        size = synth.write_synth(
            preset, out, seed=args.seed, overwrite=args.force, on_progress=progress,
            workers=args.workers, ftype=ftype,
        )
    except (OSError, ValueError) as e:
        print(f"stratactl synth: {e}", file=sys.stderr)
        return 1
    geometry = (
        f"{preset.n_experts} experts top-{preset.n_experts_used}" if preset.is_moe else "dense"
    )
    types = f", {ftype.name}" if ftype else ""
    print(
        f"wrote {out}: {preset.name} ({preset.arch}, {preset.n_layers} layers, {geometry},"
        f" hidden {preset.hidden}{types}), {size:,} bytes in {time.monotonic() - start:.1f}s"
    )
    return 0
