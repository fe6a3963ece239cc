"""STRATA_DECODE_TIMING: one log line per request with the time per decode step by stage,
and the same figures on /metrics."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.daemon import running_daemon

# what a decode step is made of, by engine: the cpu engine (what `auto` picks here) runs the
# tiny MoE's layers in one kernel call over the expert store; the reference layer by layer
STAGES = {
    "cpu": {"layers", "head", "sampling"},
    "reference": {"attention", "router", "experts", "expert fetch", "head", "sampling"},
}


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_decode_timing_log_and_metrics(tmp_path: Path, backend: str, tiny_moe_file: Path) -> None:
    model = tiny_moe_file
    log = tmp_path / "stratad.log"
    config = tmp_path / "stratad.toml"
    config.write_text(f'[engine]\ndevice = "cpu"\nbackend = "{backend}"\n')
    args = [str(model), "--config", str(config)]
    with running_daemon(args, log, env={"STRATA_DECODE_TIMING": "1"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.completions.create(
            model=model.name, prompt="Hello there", max_tokens=9, temperature=0
        )
        with urllib.request.urlopen(f"{url}/metrics") as r:
            metrics = r.read().decode()
    lines = [x for x in log.read_text().splitlines() if "decode timing:" in x]
    assert len(lines) == 1, log.read_text()
    m = re.search(
        r"decode timing: (\d+) steps, ([\d.]+) ms/step = (.*) \(ms\); expert reads", lines[0]
    )
    assert m and int(m.group(1)) == 8
    stages = dict(s.rsplit(" ", 1) for s in m.group(3).split(", "))
    assert set(stages) == STAGES[backend]
    assert abs(sum(float(v) for v in stages.values()) - float(m.group(2))) < 0.05
    inner = "layers" if backend == "cpu" else "experts"
    assert re.search(rf'^strata:decode_stage_ms_per_step\{{[^}}]*stage="{inner}"', metrics, re.M)
    prefill = [x for x in log.read_text().splitlines() if "prefill timing:" in x]
    assert len(prefill) == 1 and re.search(r"prefill timing: 2 tokens, [\d.]+ ms = ", prefill[0])
