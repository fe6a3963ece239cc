"""gpt-oss's layout (`gpt-oss`) against llama.cpp and through the daemon.

tiny-gpt-oss (`stratactl synth tiny-gpt-oss`) has every part of the layout: attention sinks,
a sliding window of 8 on even layers (the prompts outrun it), biases on every projection
and expert, routing by a softmax over the top k logits, clamped SwiGLU experts. Every tensor
is F32, so llama.cpp computes in float32 on the same values: greedy continuations agree
token for token and logits within 1e-3 (measured 2e-5). The transformers comparison is in
tests/test_transformers.py.
"""

from __future__ import annotations

from pathlib import Path

from kernels.cpu.experts import CpuExperts
from stratad.engine.offload.experts import fast_path_refusal
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.graph.activation import ClampedSwiGlu
from stratad.model.graph.routing import TopKSoftmax
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from tests.daemon import greedy_completions, running_daemon
from tests.greedy import greedy
from tests.llama_compare import assert_as_llama
from tests.tiny_presets import preset_fixtures

PROMPTS = ["The quick brown fox jumps over the lazy dog", "def fibonacci(n):"]
N_NEW = 16


_tiny_oss_file, _model = preset_fixtures("tiny-gpt-oss", "tiny_oss")


def test_spec_from_the_file(model: Model) -> None:
    s = model.spec
    assert (s.arch, s.n_layers, s.expert_ffn, s.n_experts_used) == ("gpt-oss", 4, 64, 2)
    assert s.routing == TopKSoftmax() and s.activation == ClampedSwiGlu(1.702, 7.0)
    assert s.attn_sinks and s.attn_bias and not s.norm_topk_prob
    assert [s.window(i) for i in range(4)] == [8, 0, 8, 0]
    assert model.tensors["model.layers.0.mlp.experts.down_proj_bias"].shape == (8, 256)
    assert model.tensors["model.layers.0.self_attn.sinks"].shape == (4,)


def test_reference_engine_against_llama_cpp(tiny_oss: Path, model: Model) -> None:
    assert_as_llama(ReferenceForward(model), tiny_oss, PROMPTS, N_NEW)
    # the cpu engine's one-call paths compute the plain graph; the GPU engine reads no F32
    assert fast_path_refusal(model) == "layer 0 holds F32 experts"


def test_cpu_engine_computes_its_experts_in_one_call(model: Model) -> None:
    """The cpu engine hands each layer's routed experts to the compiled kernels in one call,
    with their biases and the clamped SwiGLU (`stratad.engine.expert_ffn`): the reference's
    greedy tokens."""
    cpu = ReferenceForward(model, weights=QuantWeights(CpuExperts(2)))
    assert all(w.routed is not None for w in cpu.layers) and cpu.ffn.biases
    assert "routed experts in one kernel call" in cpu.path
    prompt = list(range(100, 120))  # past the sliding window of 8
    assert greedy(cpu, prompt, 6) == greedy(ReferenceForward(model), prompt, 6)


def test_daemon_serves_it_through_the_store(tiny_oss: Path, model: Model, tmp_path: Path) -> None:
    """The cpu engine with the experts in the store's tiers (every layer routes, so the
    store places them; their biases stay with the layer's dense weights), over HTTP, three
    requests at once (one runtime step serves them together): each the reference's greedy
    tokens of its prompt alone, past the sliding window."""
    tok = tokenizer_from_gguf(model.metadata)
    prompts = ["Hello there, this prompt is longer than the window", "def fibonacci(n):",
               "One two three four five six seven eight nine ten"]  # fmt: skip
    reference = ReferenceForward(model)
    want = [tok.decode(greedy(reference, tok.encode(p), 6)) for p in prompts]
    config = tmp_path / "stratad.toml"
    config.write_text('[engine]\ndevice = "cpu"\nthreads = 1\n[control]\nsocket = ""\n')
    log = tmp_path / "stratad.log"
    with running_daemon([str(tiny_oss), "--config", str(config)], log) as url:
        got = greedy_completions(url, tiny_oss.name, prompts, 6)
    assert got == want
    text = log.read_text()
    assert "residency plan" in text and " ERROR " not in text, text
