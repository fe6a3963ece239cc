"""`stratactl tune` writes a tuning table for a stack; the daemon's selection reads it back;
bad tables are refused with the key named; the engine runs with a table's settings."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kernels.experts.expert_fetch import FetchConfig
from kernels.layers.attention import AttentionConfig
from kernels.tuning import tables
from kernels.tuning.configs import (
    INTERPRETED,
    KernelConfigs,
    TuningTableError,
    configs_from_json,
    load_configs,
)
from stratad.engine.offload.kernel_table import configs_for

STACK = "sm90-cuda-12.8"


def _ctl(*args: str, interpret: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "stratactl", *args], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip


def test_tune_writes_a_table_that_selection_and_the_daemon_read(tmp_path: Path) -> None:
    out = tmp_path / "tables"
    r = _ctl("tune", "--preset", "tiny-moe", "--stack", STACK, "--out", str(out), "--quick",
             "--kernels", "fetch,dequant", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    written = json.loads(r.stdout)
    path = out / f"{STACK}.json"
    assert written["path"] == str(path) and written["key"] == STACK
    assert written["header"]["triton"] and written["header"]["runtime"] == "12.8"
    [bucket] = written["buckets"]
    assert set(bucket["measured_us"]) == {"fetch", "dequant"}  # only what was asked
    assert "fetch 2/2" in r.stderr and "dequant:" in r.stderr  # progress per candidate
    sel = _ctl("tables", "select", "--stack", STACK, "--tables-dir", str(out))
    assert sel.returncode == 0 and str(path) in sel.stdout
    configs, level, message = configs_for(tables.parse_name(path.name), [out])  # type: ignore[arg-type]
    assert level == logging.INFO and str(path) in message
    assert configs == load_configs(path)


def test_tune_refuses_bad_input(tmp_path: Path) -> None:
    r = _ctl("tune", "--stack", STACK, "--out", str(tmp_path), "--kernels", "moe,gemm")
    assert r.returncode == 1 and "cannot tune gemm" in r.stderr
    r = _ctl("tune", "--stack", STACK, "--out", str(tmp_path), "--kernels", "prefetch")
    assert r.returncode == 1 and "cannot tune prefetch" in r.stderr  # set by hand, see tuning.py
    r = _ctl("tune", "--stack", "h100", "--out", str(tmp_path))
    assert r.returncode == 1 and "expected ARCH-BACKEND-VERSION" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_tune_without_a_gpu_has_nothing_to_tune(tmp_path: Path) -> None:
    """A CPU host: the cpu engine's kernels need no table, which is the answer (exit 0)."""
    from stratad.engine.offload.kernel_table import kernel_configs, this_stack

    line = "no GPU: nothing to tune on a CPU (the cpu engine's kernels need no table)\n"
    r = _ctl("tune", "--stack", STACK, "--out", str(tmp_path), interpret=False)
    assert (r.returncode, r.stdout, r.stderr) == (0, line, "")
    r = _ctl("tune", "--out", str(tmp_path))  # nothing to name a table for, interpreter or not
    assert (r.returncode, r.stdout, r.stderr) == (0, line, "")
    assert not list(tmp_path.iterdir())
    assert isinstance(this_stack(), str) and kernel_configs("cpu") == INTERPRETED


@pytest.mark.parametrize(
    ("kernels", "match"),
    [
        ({"gemm": {}}, "unknown kernel 'gemm'"),
        ({"moe": {"block_m": 4}}, "unknown setting kernels.moe.block_m"),
        ({"fetch": {"block": 0}}, "kernels.fetch.block = 0 is not a positive integer"),
        ({"attention": {"split_s": True}}, "is not a positive integer"),
        ({"moe": {"int8_dots": 1}}, "kernels.moe.int8_dots = 1 is not true or false"),
    ],
)
def test_bad_tables_are_refused_with_the_key_named(kernels: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(TuningTableError, match=match):
        configs_from_json({"key": STACK, "kernels": kernels}, "t.json")


def test_a_partial_table_keeps_the_other_defaults() -> None:
    got = configs_from_json({"kernels": {"fetch": {"chunk": 32768}}})
    assert got == replace(KernelConfigs(), fetch=FetchConfig(chunk=32768))
    got = configs_from_json({"kernels": {"moe": {"int8_dots": True}}})
    moe = replace(KernelConfigs().moe, int8_dots=True)  # down too: the table has no moe_down
    assert got == replace(KernelConfigs(), moe=moe, moe_down=moe)


def test_the_daemon_falls_back_to_defaults_on_a_bad_or_missing_table(tmp_path: Path) -> None:
    stack = tables.parse_name(f"{STACK}.json")
    assert stack is not None
    configs, level, message = configs_for(stack, [tmp_path])
    assert configs == KernelConfigs() and level == logging.INFO  # the defaults, said once
    assert "no tuning table for sm90-cuda-12.8" in message
    (tmp_path / f"{STACK}.json").write_text('{"kernels": {"moe": {"block_m": 4}}}')
    configs, level, message = configs_for(stack, [tmp_path])
    assert configs == KernelConfigs() and level == logging.WARNING
    assert "kernels.moe.block_m" in message and "refused" in message


def test_engine_runs_with_a_tables_settings(tiny_moe_model) -> None:  # type: ignore[no-untyped-def]
    from stratad.engine.offload.experts import blob_layouts
    from stratad.engine.offload.forward import OffloadConfig, OffloadForward
    from stratad.engine.passes import FUSED_MAX_TOKENS
    from stratad.engine.reference.forward import ReferenceForward

    model = tiny_moe_model
    settings = replace(KernelConfigs(), attention=AttentionConfig(block_s=8, split_s=8),
                       fetch=FetchConfig(chunk=4096, block=256))  # fmt: skip
    budget = 3 * model.spec.n_layers * blob_layouts(model).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, graphs=False,
                        kernels=settings)  # fmt: skip
    off, ref = OffloadForward(model, torch.device("cpu"), cfg), ReferenceForward(model)
    # the prompt one staged chunk; then decode steps, where both settings apply: the fetch
    # copies each step's misses, attention splits 66+ positions into pieces of 8
    prompt = list(range(100, 101 + FUSED_MAX_TOKENS))
    a, b = off.new_cache(128), ref.new_cache(128)
    got, want = off(prompt, a)[-1], ref(prompt, b)[-1]
    for _ in range(2):
        tok = int(want.argmax())
        assert int(got.argmax()) == tok
        got, want = off([tok], a)[-1], ref([tok], b)[-1]
    assert (got - want).abs().max() < 1e-3


def test_a_candidate_must_clearly_beat_the_default() -> None:
    from stratad.tuning.tuner import _pick

    assert _pick([(10.0, "default"), (9.8, "a"), (9.9, "b")], margin=0.03) == (10.0, "default")
    assert _pick([(10.0, "default"), (9.5, "a"), (9.0, "b")], margin=0.03) == (9.0, "b")
    assert _pick([(float("inf"), "default"), (5.0, "a")], margin=0.03) == (5.0, "a")
