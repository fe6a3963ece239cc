"""Tuning-table lookup: the file format (header, buckets, switches), the exact stack, the nearest
runtime version of the same arch with one WARNING naming both, none (the defaults, one INFO
line), the nearest shape bucket; and the tables shipped in kernels/tables/ all read."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from kernels.experts.expert_fetch import FetchConfig
from kernels.experts.moe import MoeConfig
from kernels.formats.quant import QType
from kernels.tuning import table_file, tables
from kernels.tuning.configs import (
    KernelConfigs,
    TuningTableError,
    configs_from_json,
    configs_from_kernels,
    configs_to_json,
    load_configs,
)
from stratad.engine.offload.kernel_table import BUILTIN, configs_for_run, kernel_configs, lookup
from stratad.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
A3B = {"hidden": 2048, "ffn": 768, "top_k": 8, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128,
       "n_experts": 128}  # fmt: skip
SMALL = {**A3B, "hidden": 1024, "ffn": 256, "n_experts": 64}


def write(d: Path, key: str, **extra: object) -> Path:
    d.mkdir(exist_ok=True)
    body = {"key": key, "header": {"triton": "3.5.0", "torch": "2.9.0", "device": "GPU"},
            "buckets": [{"shapes": A3B, "kernels": {"moe": {"block_n": 64}}}], **extra}
    path = d / f"{key}.json"
    path.write_text(json.dumps(body))
    return path


def stack(key: str) -> tables.Stack:
    s = tables.parse_name(f"{key}.json")
    assert s is not None
    return s


def test_parse_header_buckets_and_switches(tmp_path: Path) -> None:
    path = write(tmp_path, "sm90-cuda-13.0",
                 switches={"gpu_miss": {"value": "in_place", "ab": {"real": True}}})
    t = table_file.read(path, "sm90-cuda-13.0")
    assert (t.header.arch, t.header.backend, t.header.runtime) == ("sm90", "cuda", "13.0")
    assert (t.header.triton, t.header.torch, t.header.device) == ("3.5.0", "2.9.0", "GPU")
    assert t.header.mismatch_cost is None and t.buckets[0].shapes == A3B
    assert t.switch_values == {"gpu_miss": "in_place"} and t.switches["gpu_miss"].ab["real"]


def test_a_table_in_the_first_format_reads_as_one_bucket() -> None:
    old = {"key": "sm90-cuda-12.8", "kernels": {"fetch": {"chunk": 32768}}, "shapes": A3B,
           "measured_us": {}, "device": "NVIDIA H200"}  # fmt: skip
    t = table_file.parse(old, "sm90-cuda-12.8")
    assert len(t.buckets) == 1 and t.header.device == "NVIDIA H200"
    assert configs_from_json(old) == replace(KernelConfigs(), fetch=FetchConfig(chunk=32768))


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"key": "sm90-cuda-12.8", "kernels": {}}, "says it was tuned for sm90-cuda-12.8"),
        ({"header": {"runtime": "12.8"}, "kernels": {}}, "its header says sm90-cuda-12.8"),
        ({"header": {"cuda": "13.0"}, "kernels": {}}, "unknown header field cuda"),
        ({"buckets": []}, "not a non-empty list"),
        ({"buckets": [{"shapes": {"hidden": "2K"}, "kernels": {}}]}, "object of integers"),
        ({"kernels": {}, "switches": {"gpu_miss": "copy"}}, "switches.gpu_miss: expected"),
    ],
)
def test_bad_files_are_refused_with_the_key_named(body: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(table_file.TableFileError, match=match):
        table_file.parse(body, "sm90-cuda-13.0", "t.json")


def test_exact_match_is_said_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(tmp_path, "sm90-cuda-12.8")
    path = write(tmp_path, "sm90-cuda-13.0")
    with caplog.at_level(logging.INFO, "stratad.engine"):
        got = kernel_configs("cuda", A3B, stack("sm90-cuda-13.0"), [tmp_path])
    # a table without "moe_down" runs down with "moe"'s settings
    moe = MoeConfig(block_n=64)
    assert got == replace(KernelConfigs(), moe=moe, moe_down=moe)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"kernel tuning table sm90-cuda-13.0: using {path}")]
    assert tables.select(stack("sm90-cuda-13.0"), [tmp_path]).exact


def test_nearest_version_is_used_with_one_warning_naming_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, "sm90-cuda-11.8")
    near = write(tmp_path, "sm90-cuda-12.8", header={
        "mismatch_cost": "decode -4%, prefill -11% on cuda 13.0"})
    write(tmp_path, "sm80-cuda-13.0")  # the same version on another arch is no candidate
    with caplog.at_level(logging.INFO, "stratad.engine"):
        got = kernel_configs("cuda", A3B, stack("sm90-cuda-13.0"), [tmp_path])
    assert got.moe == MoeConfig(block_n=64)
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    line = caplog.records[0].getMessage()
    assert f"no tuning table for sm90-cuda-13.0: using {near}, tuned for cuda 12.8, on cuda" \
        " 13.0" in line
    assert "measured cost of a mismatch: decode -4%, prefill -11% on cuda 13.0" in line
    choice = tables.select(stack("sm90-cuda-13.0"), [tmp_path])
    assert choice.reason == "nearest-version" and choice.matched and not choice.exact
    # without a recorded cost the line says it was not measured
    caplog.clear()
    with caplog.at_level(logging.INFO, "stratad.engine"):
        kernel_configs("cuda", A3B, stack("sm90-cuda-11.7"), [tmp_path])
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "tuned for cuda 11.8, on cuda 11.7" in caplog.records[0].getMessage()
    assert "the cost of the mismatch was not measured" in caplog.records[0].getMessage()


def test_down_launch_settings_of_their_own() -> None:
    got = configs_from_kernels({"moe": {"block_n": 8, "group_pairs": False},
                                "moe_down": {"block_n": 32, "super_blocks": 4}})  # fmt: skip
    assert got.moe == MoeConfig(block_n=8, group_pairs=False)
    assert got.moe_down == MoeConfig(block_n=32, super_blocks=4)
    assert configs_from_kernels({"moe_down": {"block_n": 32}}).moe == MoeConfig()


def test_the_tokens_a_dense_kernel_takes_are_a_setting() -> None:
    """`linear.max_tokens` / `qlinear.max_tokens`: the most rows of a step the decode kernels
    read (more go to torch's GEMM, or to the bf16 copy); by default one token's for the bf16
    kernel (the GEMM reads a few tokens' faster: r19), every decode step's for the GGUF one."""
    assert (KernelConfigs().linear.max_tokens, KernelConfigs().qlinear.max_tokens) == (1, 8)
    got = configs_from_kernels({"linear": {"max_tokens": 2}, "qlinear": {"max_tokens": 1}})
    assert (got.linear.max_tokens, got.qlinear.max_tokens) == (2, 1)
    with pytest.raises(TuningTableError, match="linear.max_tokens = 0"):
        configs_from_kernels({"linear": {"max_tokens": 0}})


def test_moe_launch_settings_per_type() -> None:
    """`moe@TYPE` / `moe_down@TYPE` set a launch for one GGUF type, on top of the launch's
    own settings; other types keep the launch's; written back as read."""
    got = configs_from_kernels({"moe": {"block_n": 16, "num_warps": 4},
                                "moe@q4_k": {"block_n": 2, "num_warps": 1},
                                "moe_down@q6_k": {"block_n": 4}})  # fmt: skip
    assert got.moe_for("moe", QType.Q4_K) == MoeConfig(block_n=2, num_warps=1)
    assert got.moe_for("moe", QType.Q4_0) == MoeConfig(block_n=16, num_warps=4)
    assert got.moe_for("moe_down", QType.Q6_K) == MoeConfig(block_n=4, num_warps=4)
    assert got.moe_for("moe_down", QType.Q4_K) == MoeConfig(block_n=16, num_warps=4)
    assert configs_from_kernels(configs_to_json(got)) == got
    # a split layout's own settings (Q6_K's) where the projection is held split; else the type's
    held = configs_from_kernels({"moe_down@q6_k": {"block_n": 4},
                                 "moe_down@q6_k_split": {"block_n": 8}})  # fmt: skip
    assert held.moe_for("moe_down", QType.Q6_K, split=True).block_n == 8
    assert held.moe_for("moe_down", QType.Q6_K).block_n == 4
    assert got.moe_for("moe_down", QType.Q6_K, split=True) == MoeConfig(block_n=4, num_warps=4)
    assert configs_from_kernels(configs_to_json(held)) == held
    for bad, match in (({"linear@q4_k": {}}, "only moe and moe_down take settings per type"),
                       ({"moe@q4_k_split": {}}, "'q4_k_split' is no type the MoE kernels read"),
                       ({"moe@q4_q": {}}, "'q4_q' is no type the MoE kernels read"),
                       ({"moe@q4_k": {"block_n": 0}}, "kernels.moe@q4_k.block_n = 0")):  # fmt: skip
        with pytest.raises(TuningTableError, match=match):
            configs_from_kernels(bad)


def test_the_shipped_sm90_table_sets_the_measured_types() -> None:
    path = ROOT / "kernels" / "tables" / "sm90-cuda-13.0.json"
    got = load_configs(path)
    q4_k = got.moe_for("moe", QType.Q4_K)  # the word-addressed reader's pick (H100, r22)
    assert (q4_k.block_n, q4_k.super_blocks, q4_k.num_warps) == (4, 8, 1)
    assert got.moe_for("moe", QType.Q4_0) == got.moe  # Q4_0's reader keeps the wider launch
    # Q6_K's down: as blocks 4:1:1, split 8:1:1 (the moe_types down launch, H100, r23)
    blocks, split = (got.moe_for("moe_down", QType.Q6_K, s) for s in (False, True))
    assert (blocks.block_n, split.block_n, split.super_blocks, split.num_warps) == (4, 8, 1, 1)
    assert got.moe_int8(QType.Q6_K, split=True)  # the switch q6_k_layout may say split


def test_nearest_version_rule() -> None:
    assert tables.nearest_version("13.0", ["11.8", "12.8", "13.2"]) == "13.2"
    assert tables.nearest_version("12.8", ["12.6", "12.9", "13.0"]) == "12.9"
    assert tables.nearest_version("12.8", ["12.7", "12.9"]) == "12.7"  # a tie: the older
    assert tables.nearest_version("7.2.1", ["7.1.0", "7.2.0", "6.4.3"]) == "7.2.0"


def test_no_table_runs_the_defaults_said_once_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, "gfx1100-rocm-7.2.0")  # another arch and backend
    with caplog.at_level(logging.INFO, "stratad.engine"):
        got = kernel_configs("cuda", A3B, stack("sm90-cuda-13.0"), [tmp_path])
    assert got == KernelConfigs()
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "no tuning table for sm90-cuda-13.0" in caplog.records[0].getMessage()


def test_a_broken_table_is_refused_at_warning(tmp_path: Path) -> None:
    (tmp_path / "sm90-cuda-13.0.json").write_text('{"kernels": {"moe": {"block_m": 4}}}')
    found = lookup(stack("sm90-cuda-13.0"), A3B, [tmp_path])
    assert found.configs == KernelConfigs() and found.level == logging.WARNING
    assert "kernels.moe.block_m" in found.message and "refused" in found.message


def test_a_shape_between_buckets_takes_the_nearest(tmp_path: Path) -> None:
    write(tmp_path, "sm90-cuda-13.0", buckets=[
        {"shapes": SMALL, "kernels": {"moe": {"block_n": 8}}},
        {"shapes": A3B, "kernels": {"moe": {"block_n": 64}}},
    ], switches={"gpu_miss": {"value": "in_place"}})
    s = stack("sm90-cuda-13.0")
    between_near_a3b = {**A3B, "hidden": 1536, "ffn": 640}
    between_near_small = {**SMALL, "hidden": 1280, "ffn": 320}
    assert lookup(s, between_near_a3b, [tmp_path]).configs.moe.block_n == 64
    found = lookup(s, between_near_small, [tmp_path])
    assert found.configs.moe.block_n == 8 and found.shapes == SMALL
    assert "(bucket hidden=1024 ffn=256" in found.message
    assert found.switches == {"gpu_miss": "in_place"}
    assert load_configs(tmp_path / "sm90-cuda-13.0.json", between_near_small).moe.block_n == 8
    assert load_configs(tmp_path / "sm90-cuda-13.0.json").moe.block_n == 8  # none: the first
    with pytest.raises(TuningTableError, match="not a non-empty list"):
        configs_from_json({"buckets": []})


def test_a_benchmark_runs_the_daemons_settings_unless_told(tmp_path: Path) -> None:
    """A benchmark's launch settings: the table the daemon would pick (here, no GPU stack: the
    built-in ones; on the CPU, the interpreter's), the built-in ones by name, or a file's."""
    spec = ModelSpec("qwen3moe", n_layers=2, hidden=2048, n_heads=32, n_kv_heads=4,
                     head_dim=128, vocab_size=64, rms_eps=1e-6, rope_theta=1e6,
                     context_length=4096, n_experts=128, n_experts_used=8,
                     expert_ffn=768)  # fmt: skip
    assert configs_for_run(None, spec, "cpu") == kernel_configs("cpu")
    assert configs_for_run(BUILTIN, spec) == KernelConfigs()
    path = write(tmp_path, "sm90-cuda-13.0")
    assert configs_for_run(str(path), spec).moe.block_n == 64


def test_shipped_tables_read_and_are_package_data() -> None:
    shipped = ROOT / "kernels" / "tables"
    assert shipped == tables.PACKAGED_DIR and shipped.is_dir()
    assert 'kernels = ["tables/*.json"]' in (ROOT / "pyproject.toml").read_text()
    for path in shipped.glob("*.json"):
        s = tables.parse_name(path.name)
        assert s is not None, f"{path.name}: not ARCH-BACKEND-VERSION.json"
        found = lookup(s, A3B, [shipped])
        assert found.choice is not None and found.choice.exact, found.message
        t = table_file.read(path, s.key)
        assert t.header.triton and t.header.torch and all(b.shapes for b in t.buckets)


def test_tuning_another_model_adds_its_bucket(tmp_path: Path) -> None:
    from stratactl.tune import _merged

    s = stack("sm90-cuda-13.0")
    path = write(tmp_path, s.key, header={"mismatch_cost": "prefill -9% on 12.8"},
                 switches={"gpu_miss": {"value": "copy", "ab": {"real": False}}})
    header = {"arch": "sm90", "backend": "cuda", "runtime": "13.0", "triton": "3.6.0",
              "torch": "2.10.0", "device": "GPU"}  # fmt: skip
    small = {"shapes": SMALL, "kernels": {"moe": {"block_n": 8}}, "measured_us": {}}
    merged = _merged(path, s, small, header)
    t = table_file.parse(merged, s.key)
    assert [b.shapes for b in t.buckets] == [SMALL, A3B] and t.header.triton == "3.6.0"
    assert t.header.mismatch_cost == "prefill -9% on 12.8" and t.switch_values == {
        "gpu_miss": "copy"}
    again = {"shapes": A3B, "kernels": {"moe": {"block_n": 16}}, "measured_us": {}}
    path.write_text(json.dumps(merged))
    t = table_file.parse(_merged(path, s, again, header), s.key)
    assert [(b.shapes, b.kernels) for b in t.buckets] == [
        (A3B, {"moe": {"block_n": 16}}), (SMALL, {"moe": {"block_n": 8}})]
