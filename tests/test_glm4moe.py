"""GLM-4.5's layout (`glm4moe`) against llama.cpp and through the daemon.

tiny-glm (`stratactl synth tiny-glm`) has every part of the layout: a dense first layer,
sigmoid routing with a correction bias and scaled weights, an ungated shared expert, RoPE
over half of each head, q/k/v biases. Every tensor is F32, so llama.cpp computes in float32
on the same values: greedy continuations agree token for token and logits within 1e-3
(measured 8e-6). The transformers comparison is in tests/test_transformers.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf import GGUFReader, GGUFWriter, RopeScalingType

from stratad.engine.offload.experts import fast_path_refusal
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.graph.rope_scaling import Yarn, configured
from stratad.model.graph.routing import Sigmoid
from stratad.model.spec import Model, ModelError
from stratad.model.synthetic import writer as synth
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.store.loader import load_model
from stratad.store.pack.manifest import PackError
from stratad.store.pack.write import write_pack
from tests.daemon import running_daemon
from tests.greedy import greedy
from tests.llama_compare import assert_as_llama, f32_llama, llama_greedy, llama_logits
from tests.synth_rewrite import rewrite
from tests.tiny_presets import preset_fixtures

PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
N_NEW = 16


_tiny_glm_file, _model = preset_fixtures("tiny-glm", "tiny_glm")


def test_spec_from_the_file(model: Model) -> None:
    s = model.spec
    assert (s.arch, s.n_layers, s.dense_layers, s.ffn, s.expert_ffn) == ("glm4moe", 3, 1, 256, 64)
    assert (s.shared_expert_ffn, s.rope_dim, s.rotary_dim, s.expert_scale) == (64, 32, 32, 1.5)
    assert s.routing == Sigmoid(1, 1) and s.norm_topk_prob and s.attn_bias and s.qk_norm == "none"
    assert list(s.moe_layers) == [1, 2]
    assert "model.layers.0.mlp.gate_proj.weight" in model.tensors
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in model.tensors
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in model.tensors


def test_reference_engine_against_llama_cpp(tiny_glm: Path, model: Model) -> None:
    forward = ReferenceForward(model)
    assert_as_llama(forward, tiny_glm, PROMPTS, N_NEW)
    # one row per MoE layer (the store's grid): the dense first layer has none
    assert forward.route_counts.shape == (2, 8)
    assert ((forward.route_counts > 0).sum(1) > model.spec.n_experts_used).all()


def test_yarn_against_llama_cpp(tiny_glm: Path, tmp_path: Path) -> None:
    """YaRN RoPE scaling (x4 of an original 64 positions) as a GGUF file states it, on
    tiny-glm's partial RoPE (the ramp over 32 dims): llama.cpp's tokens and logits. The
    transformers comparison of linear and YaRN scaling is in tests/test_transformers.py."""
    def yarn(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)

    tensors = [(t.name, np.asarray(t.data)) for t in GGUFReader(tiny_glm).tensors]
    path = rewrite(synth.PRESETS["tiny-glm"], tmp_path / "tiny-glm-yarn.gguf", tensors, yarn)
    model = load_model(path)
    assert model.spec.rope_scaling == Yarn(4.0, 64, 0.1 * math.log(4.0) + 1.0)
    # the same scaling set by the configuration (`model.rope_scaling`) on the plain file
    plain_spec = load_model(tiny_glm).spec
    assert configured(plain_spec, "yarn", 4.0, 64).rope_scaling == model.spec.rope_scaling
    assert configured(model.spec, "none", 4.0, 0).rope_scaling == plain_spec.rope_scaling
    assert configured(model.spec, "file", 2.0, 0) is model.spec
    forward = ReferenceForward(model)
    llm = f32_llama(path)
    prompt = llm.tokenize(PROMPTS[0].encode(), add_bos=False)
    ours = greedy(forward, prompt, N_NEW)
    assert ours == llama_greedy(llm, prompt, N_NEW)
    tokens = prompt + ours
    logits = forward(tokens, forward.new_cache(128), all_logits=True)
    assert (logits - llama_logits(llm, tokens)).abs().max() < 1e-3
    plain = ReferenceForward(load_model(tiny_glm))(tokens, forward.new_cache(128), all_logits=True)
    assert (plain - logits).abs().max() > 0.1  # the scaling moved the logits


def test_mtp_block_is_skipped(tiny_glm: Path, model: Model, tmp_path: Path) -> None:
    """Published GLM GGUFs carry a multi-token-prediction block past the layers
    (`nextn_predict_layers`, block_count one more): it is not loaded, and the model computes
    as without it."""
    preset = synth.PRESETS["tiny-glm"]

    def mtp_keys(w: GGUFWriter) -> None:
        w.add_block_count(preset.n_layers + 1)
        w.add_nextn_predict_layers(1)

    tensors = [(t.name, np.asarray(t.data)) for t in GGUFReader(tiny_glm).tensors]
    last, extra = f"blk.{preset.n_layers - 1}.", f"blk.{preset.n_layers}."
    # the MTP block: the last layer's tensors again, and its own
    block = [(n.replace(last, extra), v) for n, v in tensors if n.startswith(last)]
    block.append((f"{extra}nextn.eh_proj.weight",
                  np.zeros((preset.hidden, 2 * preset.hidden), np.float32)))  # fmt: skip
    mtp = load_model(rewrite(preset, tmp_path / "tiny-glm-mtp.gguf", tensors + block, mtp_keys))
    assert mtp.spec == model.spec
    assert not any(n.startswith(f"model.layers.{preset.n_layers}.") for n in mtp.tensors)
    tokens = [1, 2, 3, 4, 5]
    ours = ReferenceForward(mtp)(tokens, ReferenceForward(mtp).new_cache(16), all_logits=True)
    plain = ReferenceForward(model)
    assert torch.equal(ours, plain(tokens, plain.new_cache(16), all_logits=True))


def test_the_gpu_engine_says_what_it_cannot_read(model: Model) -> None:
    """F32 experts (tiny-glm's): named by the model's layer (the dense first layer is not in
    the store's grid)."""
    assert fast_path_refusal(model) == "layer 1 holds F32 experts"
    from stratad.engine.placement import choose_backend

    with pytest.raises(ModelError, match="offload engine cannot run it: layer 1 holds F32"):
        choose_backend("offload", model, torch.device("cpu"))


def test_store_plans_its_moe_layers(tiny_glm: Path, tmp_path: Path) -> None:
    """The store's grid is the MoE layers (2 of 3 here, 16 experts): `stratactl check` plans
    them; `stratactl pack` refuses, saying why (a pack counts every layer's experts)."""
    with pytest.raises(PackError, match="first 1 layers are dense is not written yet"):
        write_pack(tiny_glm, tmp_path / "pack")
    config = tmp_path / "check.toml"
    config.write_text(f'[model]\npath = "{tiny_glm}"\n[engine]\ndevice = "cpu"\n')
    out = subprocess.run([sys.executable, "-m", "stratactl", "check", "--config", str(config)],
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    plan = next(line for line in out.splitlines() if line.split()[1:2] == ["plan"])
    assert plan.startswith("ok") and "coverage 16 of 16, complete" in plan, out


def test_daemon_serves_it(tiny_glm: Path, model: Model, tmp_path: Path) -> None:
    """The default engine on a CPU (the cpu engine, the MoE layers' experts in the store's
    tiers), over HTTP, with YaRN set by the configuration: the reference's greedy tokens with
    that scaling; the start-up log gives the plan of 16 experts, the scaling and the context
    it gives."""
    tok = tokenizer_from_gguf(model.metadata)
    stretched = replace(model, spec=configured(model.spec, "yarn", 2.0, 0))
    assert stretched.spec.context_length == 8192
    want = greedy(ReferenceForward(stretched), tok.encode("Hello there"), 6)
    config = tmp_path / "stratad.toml"
    config.write_text('[model]\nrope_scaling = "yarn"\nrope_scale = 2.0\nmax_context = 8192\n'
                      '[engine]\ndevice = "cpu"\nthreads = 1\n[control]\nsocket = ""\n')
    log = tmp_path / "stratad.log"
    with running_daemon([str(tiny_glm), "--config", str(config)], log) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=tiny_glm.name, prompt="Hello there", max_tokens=6,
                                      temperature=0)  # fmt: skip
    assert r.choices[0].text == tok.decode(want)
    text = log.read_text()
    assert "16 keep a copy in RAM" in text, text
    assert "context 8192, RoPE YaRN x2 of 4,096" in text
    assert " ERROR " not in text
