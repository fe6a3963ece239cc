"""The GPU benchmark drivers run only on a GPU; here, their command lines are checked so that a
flag the code reads but the parser lacks fails in CI rather than on the GPU machine."""

from __future__ import annotations

import re
from pathlib import Path

import bench.e2e


def test_every_argument_e2e_reads_is_parsed() -> None:
    source = Path(bench.e2e.__file__).read_text()
    used = set(re.findall(r"\bargs\.([a-z_]+)", source))
    parsed = {a.dest for a in bench.e2e.parser()._actions}
    assert used and used <= parsed, f"read but not parsed: {sorted(used - parsed)}"
    args = bench.e2e.parser().parse_args(
        ["--model", "m.gguf", "--no-prefetch", "--kernel-table", "t.json", "--gpu-miss", "in_place"]
    )
    assert (
        args.prefetch == "off"
        and args.kernel_table == "t.json"  # a file, or "builtin" (configs_for_run)
        and args.gpu_miss == "in_place"
    )


def test_the_cache_fits_every_prompt_the_run_makes() -> None:
    """--profile prefills a 4,096-token chunk even when the prefill lengths are shorter."""
    short = ["--model", "m.gguf", "--prefill-lens", "1024"]
    assert bench.e2e.context_needed(bench.e2e.parser().parse_args(short)) >= 1024 + 256
    profiled = bench.e2e.parser().parse_args([*short, "--profile"])
    assert bench.e2e.context_needed(profiled) >= 4096 + 8
