"""bench.gpu.moe_pick: the fastest launch per type from a sweep, written into a table the engine
reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.gpu import moe_pick
from kernels.formats.quant import QType
from kernels.tuning.configs import load_configs

ROOT = Path(__file__).resolve().parents[1]
FMT = "q4_k_m(q6_k down)"


def _entry(tag: str, launch: str, t: int, us: float) -> tuple[str, dict]:  # type: ignore[type-arg]
    n, sb, w = (int(v) for v in tag.split(":")[:3])
    config = {"block_n": n, "super_blocks": sb, "num_warps": w, "int8_dots": True,
              "group_pairs": False}  # fmt: skip
    return f"{FMT}/aligned/t{t}/{tag}/{launch}", {"us": us, "tokens": t, "config": config}


def test_pick_takes_the_best_geometric_mean_over_counts() -> None:
    timed = {"a": {1: 10.0, 8: 100.0}, "b": {1: 9.0, 8: 130.0}, "c": {1: 20.0}}
    tag, score = moe_pick.pick(timed)  # c was not timed at 8: no candidate
    assert tag == "a" and score == pytest.approx((10 / 9) ** 0.5)


def test_the_table_gets_each_types_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = dict([
        _entry("16:1:4:i8:ng", "gate_up", 1, 36.0), _entry("16:1:4:i8:ng", "gate_up", 8, 250.0),
        _entry("2:4:1:i8:ng", "gate_up", 1, 13.6), _entry("2:4:1:i8:ng", "gate_up", 8, 75.0),
        _entry("4:1:1:i8:ng", "down", 1, 9.2), _entry("4:1:1:i8:ng", "down", 8, 47.0),
        _entry("16:1:4:i8:ng", "down", 1, 16.0), _entry("16:1:4:i8:ng", "down", 8, 101.0),
    ])  # fmt: skip
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    out = tmp_path / "table.json"
    base = ROOT / "kernels" / "tables" / "sm90-cuda-13.0.json"
    monkeypatch.setattr(sys, "argv", ["moe_pick", "--sweep", str(tmp_path / "sweep.json"),
                                      "--base", str(base), "--out", str(out)])  # fmt: skip
    moe_pick.main()
    got = load_configs(out)
    assert got.moe_for("moe", QType.Q4_K).block_n == 2
    assert got.moe_for("moe_down", QType.Q6_K).block_n == 4
    assert got.moe == load_configs(base).moe  # the launch's own settings stay
