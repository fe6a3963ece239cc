"""Synthetic GGUF models: geometry, determinism, and that llama.cpp runs them sensibly."""

from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader

from stratactl import synth as synth_cli
from stratad.model.formats.gguf_meta import gguf_metadata
from stratad.model.synthetic import writer as synth

TEXT = (
    "The history of the city begins with a small fishing village on the river, where traders"
    " from the north exchanged furs and salt for grain. Over three centuries the settlement"
    " grew into a market town, then a port, and finally the capital of the province. Its"
    " old walls still stand along the eastern bank, and every spring the fishermen carry a"
    " painted boat through the streets to remember the first families who built the harbour."
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, float]]:
    """Each small preset written once (seed 0), with the seconds it took."""
    out = {}
    folder = tmp_path_factory.mktemp("synth")
    for name in ("tiny-moe", "tiny-dense"):
        path = folder / f"{name}.gguf"
        start = time.perf_counter()
        synth.write_synth(synth.PRESETS[name], path)
        out[name] = (path, time.perf_counter() - start)
    return out


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stratactl")
    synth_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


# --- geometry --------------------------------------------------------------------------------


def test_a3b_geometry_and_size() -> None:
    p = synth.get_preset("a3b")
    assert (p.arch, p.n_layers, p.n_experts, p.n_experts_used) == ("qwen3moe", 48, 128, 8)
    assert (p.hidden, p.ffn, p.n_heads, p.n_kv_heads, p.head_dim) == (2048, 768, 32, 4, 128)
    plan = {t.name: t for t in synth.tensor_plan(p)}
    assert len(plan) == 3 + 48 * 12
    assert plan["blk.47.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plan["blk.47.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plan["blk.0.ffn_gate_inp.weight"].shape == (128, 2048)
    assert plan["blk.0.attn_q.weight"].shape == (32 * 128, 2048)
    assert plan["blk.0.attn_k.weight"].shape == (4 * 128, 2048)
    assert plan["blk.0.attn_q_norm.weight"].shape == (128,)
    assert plan["output.weight"].shape == (synth.VOCAB_SIZE, 2048)
    # One expert's three matrices in Q4_0 (18 bytes per 32 values): the unit the store moves.
    assert plan["blk.0.ffn_up_exps.weight"].nbytes // 128 == 768 * 2048 // 32 * 18
    assert 16.5e9 < synth.data_nbytes(p) < 18.5e9
    assert 29e9 < synth.n_params(p) < 31e9


def test_glm_air_geometry_and_size() -> None:
    """GLM-4.5-Air's shapes: a dense first layer, then 128 experts of 1,408 plus a shared one;
    106B parameters with SmolLM2's vocabulary (the published file's is 151,552)."""
    p = synth.get_preset("glm-4.5-air")
    plan = {t.name: t for t in synth.tensor_plan(p)}
    assert plan["blk.0.ffn_gate.weight"].shape == (10944, 4096)
    assert "blk.0.ffn_gate_exps.weight" not in plan
    assert plan["blk.45.ffn_gate_exps.weight"].shape == (128, 1408, 4096)
    assert plan["blk.45.ffn_down_shexp.weight"].shape == (4096, 1408)
    assert plan["blk.45.exp_probs_b.bias"].shape == (128,)
    assert plan["blk.1.attn_q.bias"].shape == (96 * 128,)
    assert plan["blk.1.post_attention_norm.weight"].shape == (4096,)
    assert 104e9 < synth.n_params(p) < 108e9


@pytest.mark.parametrize(("name", "layers", "experts", "billions"),
                         [("gpt-oss-20b", 24, 32, 20.0), ("gpt-oss-120b", 36, 128, 116.0)])
def test_gpt_oss_geometry_and_size(name: str, layers: int, experts: int, billions: float) -> None:
    """gpt-oss's shapes, MXFP4 experts; the parameters less the published vocabulary's
    (201,088 against SmolLM2's 49,152: 0.9B)."""
    p = synth.get_preset(name)
    plan = {t.name: t for t in synth.tensor_plan(p)}
    last = layers - 1
    assert plan[f"blk.{last}.ffn_gate_exps.weight"].shape == (experts, 2880, 2880)
    assert plan[f"blk.{last}.ffn_gate_exps.weight"].qtype == QType.MXFP4
    assert plan[f"blk.{last}.ffn_down_exps.bias"].shape == (experts, 2880)
    assert plan[f"blk.{last}.attn_sinks.weight"].shape == (64,)
    assert abs(synth.n_params(p) / 1e9 - billions) < 0.5


def test_deepseek_v2_lite_geometry_and_size() -> None:
    """DeepSeek-V2-Lite's shapes as llama.cpp's converter writes them (the expansion split
    into k_b and v_b); 15.7B parameters less the published vocabulary's (102,400: 0.2B)."""
    p = synth.get_preset("deepseek-v2-lite")
    plan = {t.name: t for t in synth.tensor_plan(p)}
    assert plan["blk.1.attn_q.weight"].shape == (16 * 192, 2048)
    assert plan["blk.1.attn_kv_a_mqa.weight"].shape == (512 + 64, 2048)
    assert plan["blk.1.attn_k_b.weight"].shape == (16, 512, 128)
    assert plan["blk.1.attn_v_b.weight"].shape == (16, 128, 512)
    assert plan["blk.1.attn_output.weight"].shape == (2048, 16 * 128)
    assert plan["blk.0.ffn_gate.weight"].shape == (10944, 2048)
    assert plan["blk.26.ffn_gate_exps.weight"].shape == (64, 1408, 2048)
    assert plan["blk.26.ffn_down_shexp.weight"].shape == (2048, 2 * 1408)
    assert "blk.26.exp_probs_b.bias" not in plan  # softmax routing: no correction bias
    assert abs(synth.n_params(p) / 1e9 - 15.5) < 0.1


def test_qwen3_next_geometry_and_size() -> None:
    """Qwen3-Next-80B-A3B's shapes as llama.cpp's converter writes them: DeltaNet layers with
    q, k, v in one projection and the gate apart, every fourth layer gated full attention;
    80B parameters less the published vocabulary's (151,936: 0.4B)."""
    p = synth.get_preset("qwen3-next-80b-a3b")
    plan = {t.name: t for t in synth.tensor_plan(p)}
    assert plan["blk.0.attn_qkv.weight"].shape == (2 * 16 * 128 + 32 * 128, 2048)
    assert plan["blk.0.attn_gate.weight"].shape == (32 * 128, 2048)
    assert plan["blk.0.ssm_ba.weight"].shape == (64, 2048)
    assert plan["blk.0.ssm_conv1d.weight"].shape == (8192, 4)
    assert plan["blk.0.ssm_a"].shape == (32,)
    assert "blk.0.attn_q.weight" not in plan
    assert plan["blk.3.attn_q.weight"].shape == (2 * 16 * 256, 2048)  # each head's q and gate
    assert plan["blk.47.ffn_gate_exps.weight"].shape == (512, 512, 2048)
    assert plan["blk.47.ffn_gate_inp_shexp.weight"].shape == (1, 2048)
    assert abs(synth.n_params(p) / 1e9 - 79.3) < 0.5


def test_unknown_preset_names_the_presets() -> None:
    names = ("tiny-moe, tiny-dense, tiny-glm, tiny-gpt-oss, tiny-qwen3-next, tiny-deepseek,"
             " gpt-oss-20b, gpt-oss-120b, glm-4.5-air, qwen3-next-80b-a3b, deepseek-v2-lite,"
             " a3b")
    with pytest.raises(synth.UnknownPreset, match=names):
        synth.get_preset("a30b")


# --- the file --------------------------------------------------------------------------------


def test_tiny_moe_is_fast_and_small(written: dict[str, tuple[Path, float]]) -> None:
    path, seconds = written["tiny-moe"]
    assert seconds < 10.0  # about 2 s on 2 cores, most of it reading SmolLM2's vocabulary
    assert path.stat().st_size < 40e6


def test_metadata_and_layout(written: dict[str, tuple[Path, float]]) -> None:
    path, _ = written["tiny-moe"]
    reader = GGUFReader(path)
    meta = gguf_metadata(reader)
    smol = {k: v for k, v, _, _ in synth._tokenizer_fields(synth.tokenizer_source())}
    assert meta["general.architecture"] == "qwen3moe"
    assert meta["qwen3moe.expert_count"] == 8
    assert meta["qwen3moe.expert_used_count"] == 2
    assert meta["qwen3moe.expert_feed_forward_length"] == 128
    assert meta["qwen3moe.attention.key_length"] == 64
    assert meta["strata.synth.preset"] == "tiny-moe"
    for key in (
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template",
    ):
        assert meta[key] == smol[key], key
    # Every tensor sits where its info says, holding the bytes its slices draw on their own:
    # what a tensor contains does not depend on what was written before it.
    tensors = {t.name: t for t in reader.tensors}
    plan = synth.tensor_plan(synth.PRESETS["tiny-moe"])
    assert [t.name for t in plan] == list(tensors)
    for t in plan:
        if t.name in ("blk.2.ffn_down_exps.weight", "blk.0.ffn_gate_inp.weight", "output.weight"):
            expected = np.concatenate([s.reshape(-1) for s in synth._slices([t], 0, workers=1)])
            assert np.array_equal(np.asarray(tensors[t.name].data).view(np.uint8).reshape(-1),
                                  expected)


def test_deterministic_and_cli(written: dict[str, tuple[Path, float]], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = written["tiny-moe"]
    again = tmp_path / "again.gguf"
    assert _cli(["synth", "tiny-moe", "-o", str(again)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert _sha256(again) == _sha256(path)

    assert _cli(["synth", "tiny-moe", "-o", str(again), "--seed", "1"]) == 1
    assert "--force" in capsys.readouterr().err
    assert _cli(["synth", "tiny-moe", "-o", str(again), "--seed", "1", "--force"]) == 0
    assert _sha256(again) != _sha256(path)
    assert not list(tmp_path.glob("*.partial"))

    assert _cli(["synth", "huge", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "tiny-moe, tiny-dense, tiny-glm, tiny-gpt-oss" in capsys.readouterr().err


def test_progress_reaches_total(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    p = synth.PRESETS["tiny-dense"]
    synth.write_synth(p, tmp_path / "d.gguf", on_progress=lambda *a: seen.append(a))
    dones = [d for d, _ in seen]
    total = sum(t.nbytes for t in synth.tensor_plan(p))
    assert dones == sorted(dones) and dones[-1] == total and {t for _, t in seen} == {total}


def test_progress_line_ends_with_the_total() -> None:
    stream = io.StringIO()
    line = synth_cli.ProgressLine("synth a3b", stream)
    for done in (0, 10**9, 5 * 10**9):
        line(done, 5 * 10**9)
    out = stream.getvalue()  # not a terminal: no redraws, and the middle call was too soon
    assert out.startswith("synth a3b: 5.00 / 5.00 GB (100%)") and out.endswith("ETA 0s\n")
    assert out.count("\n") == 1


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, stratactl.synth; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# --- llama.cpp runs it ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_llama_cpp_runs_it(written: dict[str, tuple[Path, float]], name: str) -> None:
    import llama_cpp  # a missing llama-cpp-python fails here: no silent skip

    path, _ = written[name]
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
    assert llm.n_vocab() == synth.VOCAB_SIZE
    tokens = llm.tokenize(TEXT.encode())[:64]
    assert len(tokens) == 64
    llm.eval(tokens)
    logits = np.asarray(llm.scores[:64], dtype=np.float32)  # [64, vocab]
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1.0).all()  # no position is flat
    assert len(set(logits.argmax(axis=1).tolist())) > 16  # predictions follow the input
    # The text round-trips through the borrowed tokenizer.
    assert llm.detokenize(tokens).decode().startswith(TEXT[:40])

    llm.reset()
    completion = llm.create_completion("Once upon a time", max_tokens=16, temperature=0.0)
    assert isinstance(completion, dict)
    generated = llm.tokenize(completion["choices"][0]["text"].encode(), add_bos=False)
    assert len(set(generated)) > 4


def test_parallel_writer_is_byte_identical(tmp_path: Path) -> None:
    from stratad.model.synthetic.writer import get_preset, write_synth

    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    write_synth(get_preset("tiny-moe"), one, workers=1)
    write_synth(get_preset("tiny-moe"), two, workers=2)
    assert one.read_bytes() == two.read_bytes()
