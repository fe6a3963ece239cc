"""`stratactl pack MODEL -o DIR`: convert a GGUF file or a Hugging Face directory into a pack.

The store code (and torch) is imported inside `run`, so that other verbs start fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PROGRESS_MIN_BYTES = 256 << 20  # below this a conversion takes a moment: no progress line


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pack",
        help="convert a GGUF or Hugging Face MoE model into a pack directory for the expert store",
        description=(
            "Write a pack directory: experts.bin (one 4 KiB-aligned blob per (layer, expert) in"
            " the quantized format the kernels read, each with a CRC-32), dense.bin, the"
            " metadata and manifest.json. The conversion streams one expert at a time, so a"
            " model larger than RAM converts. Point store.pack at the directory."
        ),
    )
    p.add_argument("model", metavar="MODEL", type=Path, help="GGUF file or Hugging Face directory")
    p.add_argument("-o", "--output", type=Path, required=True, help="the pack directory to write")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from stratactl.synth import ProgressLine
    from stratad.model.spec import ModelError
    from stratad.store.pack.manifest import PackError
    from stratad.store.pack.write import write_pack

    out: Path = args.output
    if out.exists() and not args.force:
        print(f"stratactl pack: {out} exists; pass --force to replace it", file=sys.stderr)
        return 1
    progress: ProgressLine | None = None

    def on_progress(done: int, total: int) -> None:
        nonlocal progress
        if progress is None and total >= PROGRESS_MIN_BYTES:
            progress = ProgressLine("pack experts")
        if progress is not None:
            progress(done, total)

    start = time.monotonic()
    try:
        manifest = write_pack(args.model, out, overwrite=args.force, on_progress=on_progress)
    except (OSError, ModelError, PackError) as e:
        print(f"stratactl pack: {e}", file=sys.stderr)
        return 1
    spec = manifest.spec
    print(
        f"wrote {out}: {spec.arch}, {spec.n_layers} layers x {spec.n_experts} experts,"
        f" experts.bin {manifest.experts_nbytes:,} bytes, dense.bin {manifest.dense_nbytes:,}"
        f" bytes in {time.monotonic() - start:.1f}s"
    )
    return 0
