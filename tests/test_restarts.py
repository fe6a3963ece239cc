"""Ten starts of one config answer the same prompts with the same tokens at temperature 0.

The CPU kernels choose each call's team size by timing it (kernels/cpu/team.py): a prompt runs
on the whole team, a decode step on whichever size measured faster in this process, tried
again now and then. So each start is a process of its own (tests/restart_tokens.py), half of
them with a team of one thread and half with two, run two at a time (each the other's busy
neighbour, which moves the measured choice). Their tokens, and the bits of every step's
logits, must all be the same: no result may follow a timing measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
STARTS = 10


def _start(threads: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.restart_tokens", str(threads)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return out


@pytest.mark.slow  # ten model loads: some 40 s on 2 cores
def test_ten_starts_answer_alike() -> None:
    teams = [1 + i % 2 for i in range(STARTS)]  # cpu_expert_threads: 1, 2, 1, 2, ...
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_start, teams))
    for threads, run in zip(teams, runs, strict=True):  # each start timed what it may use
        assert run["teams"] == ([1] if threads == 1 else [1, 2]), (threads, run["teams"])
    first = runs[0]
    assert len(first["alone"]) == 5 and len(first["batch"]) == 5
    assert any(ans[:-1] != first["alone"][0][:-1] for ans in first["alone"])  # not one answer
    for i, run in enumerate(runs[1:], 1):
        for part in ("alone", "batch"):
            for p, (a, b) in enumerate(zip(first[part], run[part], strict=True)):
                where = f"start {i} ({teams[i]} threads), {part} prompt {p}"
                assert a[:-1] == b[:-1], f"{where}: tokens"
                assert a[-1] == b[-1], f"{where}: logits"
