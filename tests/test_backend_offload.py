"""The daemon on the offload engine (`engine.backend = "offload"`): same tokens as the reference
engine with experts in all three tiers (VRAM slots, page-locked RAM, the file), the plan and
coverage on the control socket, the plan hash `stratactl check` prints. On the CPU its kernels
run in Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from tests.daemon import running_daemon

ENV = {"TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def tiny(tiny_moe_file: Path) -> Path:
    return tiny_moe_file  # the session's (tests/conftest.py)


def _config(path: Path, store: str, engine: str = "") -> Path:
    path.write_text(
        f'[engine]\nbackend = "offload"\ndevice = "cpu"\n{engine}\n[store]\n{store}\n'
    )
    return path


def test_offload_daemon_matches_reference(
    tiny: Path, tiny_moe_model: Model, tmp_path: Path
) -> None:
    model = tiny_moe_model
    tok = tokenizer_from_gguf(model.metadata)
    ref = ReferenceForward(model)
    cache = ref.new_cache(64)
    logits = ref(tok.encode("Hello there"), cache)[-1]
    want = []
    for _ in range(4):
        want.append(int(logits.argmax()))
        logits = ref([want[-1]], cache)[-1]

    # misses read in place here; the default (fetched into VRAM) is tested in test_offload.py.
    # The RAM budget holds 16 of the 32 blobs (56 KiB apart): 12 experts start in VRAM, 16
    # others keep a RAM copy, 4 are read from the file when routed.
    store = "expert_cache = 12\nresident_budget_gib = 0.00086"
    config = _config(tmp_path / "stratad.toml", store, 'gpu_miss = "in_place"')
    sock = tmp_path / "ctl.sock"
    args = [str(tiny), "--config", str(config), "--control-socket", str(sock)]
    ctl = [sys.executable, "-m", "stratactl"]
    checked_config = tmp_path / "check.toml"  # the same settings, with the model named
    checked_config.write_text(f'[model]\npath = "{tiny}"\n' + config.read_text())
    check = subprocess.run([*ctl, "check", "--json", "--config", str(checked_config)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, **ENV})  # fmt: skip
    with running_daemon(args, tmp_path / "stratad.log", env=ENV) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(
            model=tiny.name, prompt="Hello there", max_tokens=4, temperature=0
        )
        cov = subprocess.run([*ctl, "coverage", "--json", "--socket", str(sock)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        plan = subprocess.run([*ctl, "plan", "--json", "--socket", str(sock)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        stats = subprocess.run([*ctl, "stats", "--json", "--socket", str(sock)],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.choices[0].text == tok.decode(want)
    assert cov.returncode == 3, cov.stderr  # "not yet": the coverage is incomplete
    coverage = json.loads(cov.stdout)
    assert not coverage["complete"] and coverage["in_vram"] == 12 and coverage["experts"] == 32
    assert coverage["in_file_only"] == 4 and coverage["file_reads"] > 0, coverage
    # the store counts the decode steps' lookups by tier, as the other engines' stores do: the
    # file-only experts a step routed to among them (the warm-up's forgotten)
    hits = json.loads(stats.stdout)["tier_hits"]
    assert hits["file"] > 0 and hits["vram"] > 0 and hits["ram"] > 0, hits
    log = (tmp_path / "stratad.log").read_text()
    daemon_hash = json.loads(plan.stdout)["hash"]
    assert daemon_hash in log
    # the pre-start check places the same experts (one placement function for both)
    checked = next(c for c in json.loads(check.stdout)["checks"] if c["name"] == "plan")
    assert checked["detail"].startswith(f"plan {daemon_hash}:"), checked
    assert "decode misses: the GPU takes 100% (read in place)" in log


def test_auto_backend_choice(tiny_moe_model: Model, smollm_model) -> None:  # type: ignore[no-untyped-def]
    import torch

    from stratad.engine.placement import choose_backend, offload_supported

    moe = tiny_moe_model
    assert offload_supported(moe) and not offload_supported(smollm_model)
    # a GPU picks offload; a CPU serves from the blocks with the compiled CPU kernels
    assert choose_backend("auto", moe, torch.device("cpu")) == "cpu"
    assert choose_backend("auto", smollm_model, torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="serves MoE models only"):
        choose_backend("offload", smollm_model, torch.device("cpu"))


@pytest.mark.gpu
def test_check_and_daemon_place_alike_with_auto_slots_and_a_split(
    tiny: Path, tmp_path: Path
) -> None:
    """Two stages (layers 0-1 and 2-3, both on GPU 0) with auto slots: the plan hash that
    `stratactl check` prints is the one the daemon runs."""
    config = tmp_path / "stratad.toml"
    config.write_text(
        f'[model]\npath = "{tiny}"\n[engine]\nbackend = "offload"\ngpus = [0, 0]\n'
        'layer_split = "2"\n[store]\nexpert_cache = "auto"\n'
    )
    ctl = [sys.executable, "-m", "stratactl"]
    check = subprocess.run([*ctl, "check", "--json", "--config", str(config)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    sock = tmp_path / "ctl.sock"
    args = ["--config", str(config), "--control-socket", str(sock)]
    with running_daemon(args, tmp_path / "stratad.log", env={}):
        plan = subprocess.run([*ctl, "plan", "--json", "--socket", str(sock)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    daemon_hash = json.loads(plan.stdout)["hash"]
    checked = next(c for c in json.loads(check.stdout)["checks"] if c["name"] == "plan")
    assert checked["detail"].startswith(f"plan {daemon_hash}:"), checked
    assert "layers 0-1 on cuda:0, layers 2-3 on cuda:0" in (tmp_path / "stratad.log").read_text()
