"""`stratactl bench kernels`: the share of a ceiling and the flag on synthetic timings, the
shapes and type mixes read from a model file; on a CPU host the cpu engine's kernels end to
end against the host's read rate (a table naming the slowest and a JSON report), a missing
model refused; on a GPU, the real run at a3b's shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.formats.quant import QType
from kernels.tuning.roofline import Ceilings, Row, judge, table
from stratactl.__main__ import main as stratactl

CEILINGS = Ceilings(h2d_gbs=50.0, d2d_gbs=4000.0, matmul_tflops={"bfloat16": 800.0},
                    launch_us=2.0)  # fmt: skip
ROW_KEYS = {"phase", "kernel", "shape", "us", "nbytes", "flops", "link", "dtype", "rate", "unit",
            "share", "bound", "flagged"}  # fmt: skip


def test_a_kernel_under_the_threshold_is_flagged_one_above_is_not() -> None:
    # 40 MB from HBM at 4 TB/s takes 10 us: in 50 us it is at 20%, in 12.5 us at 80%
    slow = judge(Row("decode", "moe_gate_up", "-", 50.0, nbytes=40_000_000), CEILINGS, 0.3)
    fast = judge(Row("decode", "moe_gate_up", "-", 12.5, nbytes=40_000_000), CEILINGS, 0.3)
    assert slow.flagged and slow.share == pytest.approx(0.2) and slow.bound == "d2d"
    assert not fast.flagged and fast.share == pytest.approx(0.8)
    assert fast.unit == "GB/s" and fast.rate == pytest.approx(3200.0)
    out = table([slow, fast], 0.3)
    assert out.count("<< slow") == 1 and "1 of 2 kernels under 30%" in out


def test_each_row_is_held_to_the_ceiling_that_bounds_it() -> None:
    # host→device: 5 MB over a 50 GB/s link is 100 us
    fetch = judge(Row("decode", "fetch", "-", 125.0, nbytes=5_000_000, link="h2d"), CEILINGS)
    assert fetch.bound == "h2d" and fetch.share == pytest.approx(0.8)
    # 8 TFLOP at 800 TFLOP/s: 10 ms; its bytes are nothing beside it
    gemm = judge(Row("prefill", "gemm", "-", 20_000.0, nbytes=10**6, flops=8 * 10**12), CEILINGS)
    assert (gemm.bound, gemm.unit) == ("matmul", "TFLOP/s") and gemm.share == pytest.approx(0.5)
    assert gemm.rate == pytest.approx(400.0)
    # a few bytes: the launch floor is the ideal, not a share of HBM that no launch reaches
    tiny = judge(Row("decode", "route_topk", "-", 2.5, nbytes=300), CEILINGS)
    assert tiny.bound == "launch" and tiny.share == pytest.approx(0.8) and not tiny.flagged


def test_the_shapes_and_each_type_mix_the_experts_hold() -> None:
    """A Q4_K_M-like file: Q4_K gate/up everywhere, Q6_K down in some layers."""
    import torch

    from kernels.formats.quant import QTensor
    from stratad.model.spec import Model, ModelSpec
    from stratad.tuning.kernel_bench import BenchShapes, expert_mixes

    spec = ModelSpec("qwen3moe", n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64,
                     vocab_size=1000, rms_eps=1e-6, rope_theta=1e6, context_length=4096,
                     qk_norm="head", n_experts=8, n_experts_used=2, expert_ffn=128)  # fmt: skip
    down = [QType.Q6_K, QType.Q4_K, QType.Q4_K, QType.Q6_K]
    types = [(("gate", QType.Q4_K), ("up", QType.Q4_K), ("down", d)) for d in down]
    tensors = {f"model.layers.{i}.mlp.experts.{p}_proj": QTensor(torch.empty(0), q, (8, 1, 1))
               for i in range(4) for p, q in types[i]}  # fmt: skip
    mixes = expert_mixes(Model(spec, tensors, Path("m.gguf")))
    assert mixes == ((QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.Q4_K,) * 3)
    shapes = BenchShapes.of(spec, mixes)
    assert (shapes.hidden, shapes.ffn, shapes.n_experts, shapes.top_k) == (256, 128, 8, 2)
    assert shapes.qk_norm and shapes.qkv_rows == 512 and shapes.vocab == 1000
    assert "Q4_K/Q4_K/Q6_K" in shapes.describe()


def test_every_kernel_once_per_type_it_reads() -> None:
    """The cases of a Q4_K_M-like model: the gate/up launch once for Q4_K, the down launch and
    prefill's dequantization once per down type, every other kernel once per phase."""
    import torch

    from stratad.tuning.kernel_bench import GROUPS, INTERPRETED_BENCH, BenchShapes, cases

    mixes = ((QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.Q4_K,) * 3)
    s = BenchShapes(256, 4, 2, 64, 256, 8, 2, 1000, True, mixes, context=8, cache=16, prefill=4)
    built = list(cases(s, torch.device("cpu"), torch.float32, INTERPRETED_BENCH))
    names = [f"{c.phase} {c.kernel}" for c in built]
    assert len(names) == len(set(names)) and {c.group for c in built} == set(GROUPS)
    moe = [n for n in names if "moe_" in n or "dequant" in n]
    assert moe == ["decode moe_gate_up Q4_K", "decode moe_down Q6_K", "decode moe_down Q4_K",
                   "prefill dequant Q4_K gate/up", "prefill dequant Q6_K down",
                   "prefill dequant Q4_K down"]  # fmt: skip
    for phase in ("decode", "prefill"):
        for kernel in ("linear qkv", "linear o", "linear router", "rmsnorm", "add_rmsnorm",
                       "route_topk"):  # fmt: skip
            assert any(n.startswith(f"{phase} {kernel}") for n in names), (phase, kernel)
    assert all(c.nbytes > 0 for c in built)


def test_the_report_names_the_slowest_against_its_ceiling() -> None:
    rows = [judge(Row("decode", "a", "-", 12.5, nbytes=40_000_000), CEILINGS),
            judge(Row("decode", "b", "-", 50.0, nbytes=40_000_000), CEILINGS)]  # fmt: skip
    assert table(rows, 0.3).splitlines()[-1] == "slowest: decode b, 20% of its ceiling (d2d)"


def test_a_cpu_row_is_held_to_the_read_rate() -> None:
    """The cpu engine's link is the host's memory read rate: 40 MB at 20 GB/s is 2 ms."""
    cpu = Ceilings(0.0, 0.0, {"float32": 0.1}, launch_us=5.0, read_gbs=20.0)
    row = judge(Row("decode", "matmul q", "-", 4000.0, nbytes=40_000_000, flops=2 * 10**7,
                    link="read", dtype="float32"), cpu)  # fmt: skip
    assert (row.bound, row.unit) == ("read", "GB/s") and row.share == pytest.approx(0.5)


def test_the_cpu_products_of_a_dense_preset() -> None:
    from stratad.model.synthetic.presets import PRESETS
    from stratad.tuning.cpu_kernel_bench import CpuShapes

    s = CpuShapes.of_preset(PRESETS["tiny-dense"])
    got = [(p.names, p.rows, p.cols, p.qtype.name, p.prefill) for p in s.products]
    assert got == [("q/o", 256, 256, "F32", True), ("k/v", 128, 256, "F32", True),
                   ("gate/up", 512, 256, "Q8_0", True), ("down", 256, 512, "Q8_0", True),
                   ("head", 49152, 256, "Q8_0", False)]  # fmt: skip
    assert s.mixes == () and s.n_experts == 0 and s.left_out == ()


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-moe in llama-quantize's Q4_K_M types: q, o and the head each their own type, the
    experts' down in Q5_0 on some layers and Q8_0 on others."""
    from stratad.model.synthetic.ftype_rules import get_ftype
    from stratad.model.synthetic.writer import get_preset, write_synth

    path = tmp_path_factory.mktemp("cpu-bench") / "tiny-moe-q4_k_m.gguf"
    write_synth(get_preset("tiny-moe"), path, ftype=get_ftype("q4_k_m"))
    return path


@pytest.fixture(scope="module")
def cpu_run(q4_k_m: Path) -> tuple[subprocess.CompletedProcess, dict]:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command benchmarks its kernels (the GPU test)")
    out = q4_k_m.parent / "report.json"
    r = subprocess.run([sys.executable, "-m", "stratactl", "bench", "kernels", "--model",
                        str(q4_k_m), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text())


def test_the_cpu_products_of_a_model_file_each_type_once(q4_k_m: Path) -> None:
    from stratad.store.loader import load_model
    from stratad.tuning.cpu_kernel_bench import CpuShapes

    model = load_model(q4_k_m)
    s = CpuShapes.of_model(model)
    t = model.tensor
    attn = "model.layers.{}.self_attn.{}_proj.weight"
    for name in ("q", "k", "v", "o"):  # every layer's type of each projection is timed
        types = {t(attn.format(i, name)).qtype for i in range(model.spec.n_layers)}
        assert types <= {p.qtype for p in s.products if name in p.names.split("/")}, name
    assert [p.names for p in s.products if not p.prefill] == ["head"]
    down = "model.layers.{}.mlp.experts.down_proj"
    downs = [t(down.format(i)).qtype for i in range(model.spec.n_layers)]
    assert [m[2] for m in s.mixes] == list(dict.fromkeys(downs)) and len(s.mixes) == 2
    assert (s.hidden, s.ffn, s.n_experts, s.top_k, s.prefill) == (256, 128, 8, 2, 128)


def test_on_a_cpu_host_the_cpu_engines_kernels_are_held_to_the_read_rate(
    cpu_run: tuple[subprocess.CompletedProcess, dict],
) -> None:
    r, report = cpu_run
    lines = r.stdout.splitlines()
    read = report["ceilings"]["read_gbs"]
    assert lines[0].startswith("device: ") and f"host's read rate ({read:.1f} GB/s)" in lines[0]
    assert lines[1] == "the GPU kernels are not benchmarked on a CPU host"
    assert "interpreter" not in r.stdout and "decode_attention" not in r.stdout  # no Triton
    header = lines[2].split()
    assert header == ["phase", "kernel", "shape", "us", "weights", "GB/s", "of", "read", "share",
                      "bound"]  # fmt: skip
    rows = [ln for ln in lines if ln.split()[0] in ("decode", "batch4", "batch8", "prefill")]
    assert len(rows) == len(report["rows"])
    kernels = {ln[9:39].strip() for ln in rows}  # the kernel column
    assert {"matmul q Q4_K", "matmul k/v Q8_0", "matmul o Q5_K", "matmul router F32",
            "matmul head Q6_K", "experts Q4_K/Q4_K/Q5_0", "experts Q4_K/Q4_K/Q8_0"} <= kernels
    for row, line in zip(report["rows"], rows, strict=True):
        gbs = row["nbytes"] / row["us"] / 1e3
        assert row["link"] == "read" and row["nbytes"] > 0
        assert row["read_share"] == pytest.approx(gbs / read, rel=1e-3)
        cells = line[67:].split()  # past the shape: us, weights (value unit), GB/s, of read
        assert float(cells[3]) == pytest.approx(gbs, abs=0.006)
        assert cells[4] == f"{gbs / read:.0%}"
    phases = {(row["phase"], row["kernel"]) for row in report["rows"]}
    for phase in ("decode", "batch4", "batch8", "prefill"):
        assert (phase, "experts Q4_K/Q4_K/Q8_0") in phases and (phase, "matmul q Q4_K") in phases
    assert ("prefill", "matmul head Q6_K") not in phases  # a prompt's last token only
    slowest = min(report["rows"], key=lambda row: row["share"])
    assert report["slowest"] == f"{slowest['phase']} {slowest['kernel']}"
    assert lines[-2].startswith(f"slowest: {report['slowest']}, ")
    assert "kernels under 30% of the ceiling" in lines[-3]
    assert "ceilings: read" in r.stderr and "[ 1] decode matmul q Q4_K" in r.stderr  # progress


def test_the_cpu_json_report_holds_versions_device_ceilings_and_rows(
    cpu_run: tuple[subprocess.CompletedProcess, dict],
) -> None:
    _, report = cpu_run
    assert {"schema", "seconds", "versions", "device", "model", "ceilings", "flag_below", "rows",
            "flagged", "slowest"} <= report.keys()  # fmt: skip
    assert report["schema"] == 1 and 0 < report["seconds"] < 120
    assert {"strata", "torch", "python"} <= report["versions"].keys()
    assert report["device"]["type"] == "cpu" and report["device"]["threads"] >= 1
    assert report["model"]["arch"] == "qwen3moe"
    assert report["model"]["shapes"]["mixes"] == [["Q4_K", "Q4_K", "Q5_0"],
                                                  ["Q4_K", "Q4_K", "Q8_0"]]  # fmt: skip
    assert report["ceilings"].keys() == {"read_gbs", "matmul_tflops", "launch_us"}
    assert report["ceilings"]["read_gbs"] > 0 and report["ceilings"]["matmul_tflops"]["float32"]
    for row in report["rows"]:
        assert row.keys() == ROW_KEYS | {"read_share"} and row["us"] > 0
    flagged = [f"{r['phase']} {r['kernel']}" for r in report["rows"] if r["flagged"]]
    assert report["flagged"] == flagged
    assert all((r["share"] < report["flag_below"]) == r["flagged"] for r in report["rows"])


def test_a_cpu_host_refuses_only_gpu_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert stratactl(["bench", "kernels", "--model", "tiny-moe", "--kernels", "attention"]) == 1
    assert "no kernel of the cpu engine among them" in capsys.readouterr().err


def test_a_missing_model_file_is_refused_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.gguf"
    assert stratactl(["bench", "kernels", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"--model {missing}: no such model file" in err and "a3b" in err
    assert stratactl(["bench", "kernels", "--kernels", "moe,warp"]) == 1
    assert "unknown warp" in capsys.readouterr().err


def test_the_verb_module_does_not_import_torch() -> None:
    code = "import sys, stratactl.bench; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.gpu
def test_a3b_on_the_gpu_in_under_two_minutes_no_kernel_far_off(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = ["bench", "kernels", "--model", "a3b", "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "stratactl", *cmd], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["device"]["type"] == "cuda" and report["seconds"] < 120
    far = [(row["phase"], row["kernel"], row["share"]) for row in report["rows"]
           if row["share"] < 0.05]  # fmt: skip
    assert not far, f"kernels under 5% of their ceiling: {far}\n{r.stdout}"
    assert len(report["rows"]) >= 20, r.stderr  # every case ran
