"""The kernel-path switches: the configuration's setting, else the tuning table's A/B/A default,
else the built-in one; the placement and the engine choose alike."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kernels.experts.moe import MoeConfig
from kernels.tuning import ab, tables
from kernels.tuning.configs import KernelConfigs
from stratad.config import EngineConfig, parse_config
from stratad.engine.offload.kernel_table import lookup
from stratad.engine.offload.switches import dense_form, miss_paths, q6_k_layout

TABLE = "sm90-cuda-13.0"


def engine(text: str = "") -> EngineConfig:
    return parse_config(f"[engine]\n{text}\n").engine


def test_built_in_defaults_without_a_table() -> None:
    paths = miss_paths(engine(), {})
    assert (paths.copy, paths.prefetching, paths.balanced) == (True, True, False)
    assert "gpu_miss copy (default)" in paths.line()


def test_the_table_sets_what_the_configuration_leaves_to_auto() -> None:
    recorded = {"gpu_miss": "copy", "expert_prefetch": "off", "cpu_split": "balanced"}
    paths = miss_paths(engine(), recorded, TABLE)
    assert (paths.copy, paths.prefetching, paths.balanced) == (True, False, True)
    assert f"expert_prefetch off (table {TABLE} (A/B/A))" in paths.line()
    # a JSON boolean reads as on/off
    assert miss_paths(engine(), {"expert_prefetch": True}, TABLE).prefetching


def test_the_q6_k_layout_is_the_tables_where_its_int8_dots_run() -> None:
    """`q6_k_layout`: blocks by default, the table's `split` where the table also dots Q6_K
    in int8 (the split layout's only reader), else blocks, saying why."""
    int8 = KernelConfigs(moe=MoeConfig(int8_dots=True), moe_down=MoeConfig(int8_dots=True))
    assert str(q6_k_layout({}, int8)) == "blocks (default)"
    assert q6_k_layout({"q6_k_layout": "split"}, int8, TABLE).value == "split"
    assert q6_k_layout({"q6_k_layout": "interleaved"}, int8, TABLE).value == "blocks"
    half = replace(int8, moe_down=MoeConfig())
    kept = q6_k_layout({"q6_k_layout": "split"}, half, TABLE)
    assert kept.value == "blocks" and "int8 dots are off" in kept.source


def test_the_dense_form_is_the_tables() -> None:
    assert str(dense_form({})) == "bf16 (default)"
    assert str(dense_form({"dense_form": "gguf"}, TABLE)) == f"gguf (table {TABLE} (A/B/A))"
    assert dense_form({"dense_form": "fp8"}, TABLE).value == "bf16"


def test_the_configuration_wins_over_the_table() -> None:
    recorded = {"gpu_miss": "in_place", "expert_prefetch": "off", "cpu_split": "balanced"}
    paths = miss_paths(engine("gpu_miss = \"copy\"\nexpert_prefetch = true\npcie_frac = 1.0"),
                       recorded, TABLE)  # fmt: skip
    assert (paths.copy, paths.prefetching, paths.balanced) == (True, True, False)
    assert paths.gpu_miss.source == "engine.gpu_miss"


def test_prefetch_follows_the_miss_path() -> None:
    # in place has nothing to copy a guess into; an explicit prefetch keeps the copy path
    paths = miss_paths(engine(), {"gpu_miss": "in_place"}, TABLE)
    assert not paths.copy and not paths.prefetching
    assert paths.prefetch.source == "gpu_miss in_place"
    paths = miss_paths(engine("expert_prefetch = true"), {"gpu_miss": "in_place"}, TABLE)
    assert paths.copy and paths.prefetching


def test_a_value_this_program_does_not_know_falls_back_to_the_default() -> None:
    paths = miss_paths(engine(), {"gpu_miss": "teleport"}, TABLE)
    assert paths.copy
    assert "'teleport' is not a setting" in paths.gpu_miss.source


def test_a_recorded_verdict_reaches_the_engine_settings(tmp_path: Path) -> None:
    """ab.record -> the table file -> lookup -> miss_paths, as bench.gpu.ab_switch writes it."""
    slow = iter([40.0, 41.0, 40.5, 40.2]).__next__
    fast = iter([55.0, 55.5, 54.8]).__next__
    verdict = ab.run_ab(("copy", slow), ("in_place", fast))
    table = {"key": TABLE, "kernels": {},
             "switches": {"gpu_miss": ab.record(verdict, {"copy": "copy", "in_place": "in_place"})}}
    (tmp_path / f"{TABLE}.json").write_text(json.dumps(table))
    stack = tables.parse_name(f"{TABLE}.json")
    assert stack is not None
    found = lookup(stack, None, [tmp_path])
    assert found.table == TABLE
    paths = miss_paths(engine(), found.switches, found.table)
    assert not paths.copy and not paths.prefetching


def test_balanced_is_asked_for_whatever_the_table_says() -> None:
    paths = miss_paths(engine('pcie_frac = "balanced"'), {"cpu_split": "off"}, TABLE)
    assert paths.balanced and paths.cpu_split.source == "engine.pcie_frac"
    assert not miss_paths(engine("pcie_frac = 0.5"), {"cpu_split": "balanced"}, TABLE).balanced
