"""DeepSeek-V3's layout (`deepseek2`) against llama.cpp and through the daemon.

tiny-deepseek (`stratactl synth tiny-deepseek`) has every part of the layout: multi-head
latent attention with queries through a latent and values narrower than keys (written as
llama.cpp's converter writes it: the expansion split into k_b and v_b), a dense first layer,
an ungated shared expert, sigmoid routing with a correction bias, scaled weights. Every
tensor is F32, so llama.cpp computes in float32 on the same values (its cache holds the
latent, absorbing k_b into the queries: the same arithmetic in another order): greedy
continuations agree token for token and logits within 1e-3. The transformers comparison
(V3's and V2-Lite's forms) is in tests/test_transformers.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf import GGUFReader, GGUFWriter, RopeScalingType

from stratad.engine.kv_format import PLAIN
from stratad.engine.offload.config import pool_spec, values_are_keys
from stratad.engine.placement import kv_token_bytes
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.graph.mla import Mla
from stratad.model.graph.routing import Sigmoid
from stratad.model.spec import Model
from stratad.model.synthetic import writer as synth
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.store.loader import load_model
from tests.daemon import running_daemon
from tests.greedy import greedy
from tests.llama_compare import assert_as_llama
from tests.synth_rewrite import rewrite
from tests.tiny_presets import preset_fixtures

PROMPTS = ["The quick brown fox", "def fibonacci(n):"]


_tiny_file, _model = preset_fixtures("tiny-deepseek", "tiny")


def test_spec_from_the_file(model: Model) -> None:
    """The latent cache's metadata (one KV head of rank + rope) read as MLA's own."""
    s = model.spec
    assert (s.arch, s.n_layers, s.dense_layers, s.n_heads, s.n_kv_heads) == ("deepseek2", 3, 1,
                                                                          4, 4)  # fmt: skip
    assert (s.head_dim, s.value_dim, s.mla) == (48, 24, Mla(48, 64, 16))
    assert s.routing == Sigmoid(1, 1) and s.norm_topk_prob and s.expert_scale == 1.5
    assert s.rope_interleaved and s.rotary_dim == 16
    # the expansion read back from k_b and v_b: per head 32 key dims, then 24 value dims
    assert model.tensors["model.layers.0.self_attn.k_b_proj.weight"].shape == (4, 64, 32)
    # the reference's keys and values of their own sizes: 4 heads x (48 + 24) x 2 bytes x 3
    # layers; the offload engine's latent rows, one head of 64 + 16, its keys and its values
    assert kv_token_bytes(s, torch.float16, PLAIN) == 4 * (48 + 24) * 2 * 3
    assert kv_token_bytes(pool_spec(s), torch.float16, PLAIN, values_are_keys(s)) == 80 * 2 * 3


def test_reference_engine_against_llama_cpp(tiny: Path, model: Model) -> None:
    forward = ReferenceForward(model)
    assert_as_llama(forward, tiny, PROMPTS, 16)
    assert forward.route_counts.shape == (2, 8)  # the MoE layers (the store's grid)


@pytest.mark.parametrize("log_mul", [0.0707, 0.0], ids=["mscale-all-dim", "no-multiplier"])
def test_yarn_against_llama_cpp(tiny: Path, tmp_path: Path, log_mul: float) -> None:
    """DeepSeek's YaRN (x4 of an original 16 positions) as its converter writes it: with
    V2-Lite's yarn_log_multiplier (0.1 * mscale_all_dim 0.707), and without one; llama.cpp's
    tokens and logits past the original context."""
    def yarn(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(16)
        if log_mul:
            w.add_rope_scaling_yarn_log_mul(log_mul)

    tensors = [(t.name, np.asarray(t.data)) for t in GGUFReader(tiny).tensors]
    path = rewrite(synth.PRESETS["tiny-deepseek"], tmp_path / "yarn.gguf", tensors, yarn)
    spec = load_model(path).spec
    mscale = 0.1 * (log_mul / 0.1 if log_mul else 1.0) * math.log(4.0) + 1.0
    assert spec.attn_scale == pytest.approx(mscale**2)
    assert_as_llama(ReferenceForward(load_model(path)), path, [PROMPTS[0] * 3], 8)


def test_older_files_hold_the_expansion_whole(tiny: Path, model: Model, tmp_path: Path) -> None:
    """Files converted before llama.cpp cached the latent hold the expansion as one tensor,
    `attn_kv_b` [H (nope + v), rank], and state a KV head per head with MLA's own key and
    value lengths: the same model."""
    p = synth.PRESETS["tiny-deepseek"]

    def whole_head(w: GGUFWriter) -> None:  # the older metadata's head counts and lengths
        w.add_head_count_kv(p.n_heads)
        w.add_key_length(p.head_dim)
        w.add_value_length(p.v_head_dim)

    tensors = []
    reader = GGUFReader(tiny)
    for t in reader.tensors:
        if t.name.endswith("attn_v_b.weight"):
            continue
        if t.name.endswith("attn_k_b.weight"):  # [H, rank, nope] and [H, v, rank] as one
            k_b = np.asarray(t.data)
            v_b = np.asarray(reader.get_tensor(_index(reader, t.name.replace("k_b", "v_b"))).data)
            both = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
            tensors.append((t.name.replace("attn_k_b", "attn_kv_b"),
                            both.reshape(-1, both.shape[-1]).copy()))  # fmt: skip
            continue
        tensors.append((t.name, np.asarray(t.data)))
    old = load_model(rewrite(p, tmp_path / "kv_b.gguf", tensors, whole_head))
    assert old.spec == model.spec
    assert "model.layers.0.self_attn.kv_b_proj.weight" in old.tensors
    tokens = list(range(300, 320))
    a, b = ReferenceForward(old), ReferenceForward(model)
    assert torch.allclose(a(tokens, a.new_cache(32), all_logits=True),
                          b(tokens, b.new_cache(32), all_logits=True), atol=1e-5)  # fmt: skip


def _index(reader: GGUFReader, name: str) -> int:
    return next(i for i, t in enumerate(reader.tensors) if t.name == name)


def test_daemon_serves_it(tiny: Path, model: Model, tmp_path: Path) -> None:
    """The default engine on a CPU (layer by layer, the MoE layers' experts in the store's
    tiers), over HTTP: the reference's greedy tokens."""
    tok = tokenizer_from_gguf(model.metadata)
    want = greedy(ReferenceForward(model), tok.encode("Hello there"), 6)
    config = tmp_path / "stratad.toml"
    config.write_text('[engine]\ndevice = "cpu"\nthreads = 1\n[control]\nsocket = ""\n')
    log = tmp_path / "stratad.log"
    with running_daemon([str(tiny), "--config", str(config)], log) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=tiny.name, prompt="Hello there", max_tokens=6,
                                      temperature=0)  # fmt: skip
    assert r.choices[0].text == tok.decode(want)
    text = log.read_text()
    assert "16 keep a copy in RAM" in text, text
    assert " ERROR " not in text


def test_a_snapshot_budget_counts_values_of_their_own_width(model: Model) -> None:
    """The reference's latent-attention pool holds values narrower than its keys (24 against
    48 dims a head): a conversation set aside fits a budget of exactly its own bytes."""
    from stratad.runtime.prefix import PrefixStore

    ref = ReferenceForward(model)
    cache = ref.new_cache(64)
    ref(list(range(3, 27)), cache)
    layers = [i for i, k in enumerate(cache.k) if k.shape[0]]
    assert cache.v[layers[0]].shape[-1] < cache.k[layers[0]].shape[-1]
    exact = 24 * sum(cache.k[i][0].nbytes + cache.v[i][0].nbytes for i in layers)
    assert not PrefixStore(exact - 1, 0).save(cache, 24)
    store = PrefixStore(exact, 0)
    assert store.save(cache, 24) and store.bytes_used() == exact
