"""The A/B/A driver on synthetic timings: a real difference, one inside the spread, one inside
the noise floor of its kind, drift cancelled by the A-first-and-last order; and the verdict
recorded as a table's switch default that the lookup reads back."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernels.tuning import ab, tables
from stratad.engine.offload.kernel_table import lookup


def series(*values: float) -> Callable[[], float]:
    it: Iterator[float] = iter(values)
    return lambda: next(it)


def test_a_real_difference_is_called() -> None:
    # decode tok/s: B is 15% faster, each arm within ±1%
    v = ab.run_ab(("copy", series(50.0, 50.4, 49.8, 50.1)), ("in_place", series(57.5, 57.9, 57.2)),
                  rounds=3, kind="decode")  # fmt: skip
    assert v.a.median == pytest.approx(50.05) and v.b.median == 57.5
    assert v.real and v.better == "in_place" and v.difference == pytest.approx(0.1489, abs=1e-3)
    assert "in_place is better" in v.summary()
    assert ab.record(v, {"copy": "copy", "in_place": "in_place"})["value"] == "in_place"


def test_a_difference_inside_the_spread_is_not_real() -> None:
    # long cold reads (floor ±1%): B's median 3.4% higher, but the arms scatter ±3% and ±2.4%
    v = ab.run_ab(("off", series(100.0, 106.0, 103.0, 100.0)), ("on", series(103.0, 105.0, 108.0)),
                  rounds=3, kind="cold-read")  # fmt: skip
    assert v.difference == pytest.approx(0.0345, abs=1e-3)
    assert v.noise == pytest.approx(0.0296 + 0.0238, abs=1e-3)
    assert not v.real and v.better is None and "no real difference" in v.summary()
    assert ab.record(v, {"off": False, "on": True})["value"] is False  # the default stays


def test_tight_arms_still_need_to_beat_the_kinds_floor() -> None:
    samples_a, samples_b = (842.2, 842.3, 842.1, 842.2), (849.4, 849.5, 849.3)  # +0.9%
    cold = ab.run_ab(("a", series(*samples_a)), ("b", series(*samples_b)), kind="cold-read")
    prompt = ab.run_ab(("a", series(*samples_a)), ("b", series(*samples_b)), kind="prompt-8k")
    assert cold.noise == 0.01 and not cold.real  # 0.9% < the ±1% of cold reads
    assert prompt.noise == 0.07 and not prompt.real
    faster = ab.run_ab(("a", series(*samples_a)), ("b", series(904.0, 904.1, 903.9)),
                       kind="cold-read")
    assert faster.real and faster.better == "b"  # +7.3% beats ±1%


def test_lower_is_better_for_times_and_the_order_is_a_first_and_last() -> None:
    order: list[str] = []

    def arm(name: str, value: float) -> Callable[[], float]:
        def measure() -> float:
            order.append(name)
            return value
        return measure

    v = ab.run_ab(("A", arm("A", 10.0)), ("B", arm("B", 12.0)), rounds=2, kind="kernel",
                  higher_is_better=False)  # fmt: skip
    assert order == ["A", "B", "A", "B", "A"]
    assert v.real and v.better == "A"  # B takes 20% longer


def test_a_drift_does_not_make_a_difference() -> None:
    # the machine slows 2% per sample; both arms are the same configuration
    drift = iter(100.0 * 0.98**i for i in range(7))
    v = ab.run_ab(("A", lambda: next(drift)), ("B", lambda: next(drift)), rounds=3,
                  kind="cold-read")  # fmt: skip
    assert not v.real


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rounds"):
        ab.run_ab(("a", series()), ("b", series()), rounds=0)
    with pytest.raises(ValueError, match="one of cold-read"):
        ab.run_ab(("a", series()), ("b", series()), kind="prefill")


def test_the_recorded_default_is_read_by_the_lookup(tmp_path: Path) -> None:
    v = ab.run_ab(("copy", series(50.0, 50.4, 49.8, 50.1)), ("in_place", series(57.5, 57.9, 57.2)))
    table = {"key": "sm90-cuda-13.0", "kernels": {},
             "switches": {"gpu_miss": ab.record(v, {"copy": "copy", "in_place": "in_place"})}}
    path = tmp_path / "sm90-cuda-13.0.json"
    path.write_text(json.dumps(table))
    stack = tables.parse_name(path.name)
    assert stack is not None
    found = lookup(stack, None, [tmp_path])
    assert found.switches == {"gpu_miss": "in_place"}
    assert json.loads(path.read_text())["switches"]["gpu_miss"]["ab"]["real"] is True


def test_the_switch_cli_runs_commands_and_records_the_default(tmp_path: Path) -> None:
    import subprocess
    import sys

    # each sample is a real process writing its figure; B ("fast") measures 20% higher
    script = tmp_path / "arm.py"
    script.write_text("import json, sys\n"
                      "json.dump({'tps': 60.0 if sys.argv[1] == 'fast' else 50.0},"
                      " open(sys.argv[2], 'w'))\n")
    table = tmp_path / "sm90-cuda-13.0.json"
    table.write_text(json.dumps({"key": "sm90-cuda-13.0", "kernels": {}}))
    r = subprocess.run([sys.executable, "-m", "bench.gpu.ab_switch", "--switch", "gate_up",
                        "--values", "slow,fast", "--metric", "tps", "--rounds", "2",
                        "--cmd", f"{sys.executable} {script} {{value}} {{json}}",
                        "--table", str(table)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gate_up: slow 50 ±0.0% (n=3), fast 60 ±0.0% (n=2)" in r.stdout
    assert "fast is better" in r.stdout
    stack = tables.parse_name(table.name)
    assert stack is not None and lookup(stack, None, [tmp_path]).switches == {"gate_up": "fast"}
