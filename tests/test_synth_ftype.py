"""`stratactl synth --ftype`: llama.cpp's per-tensor type rules, the files, llama.cpp runs them."""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from stratactl import synth as synth_cli
from stratad.model.synthetic import writer as synth
from stratad.model.synthetic.ftype_rules import (
    FTYPES,
    ModelShape,
    fallback,
    get_ftype,
    tensor_type,
)
from tests.gguf_scan import scan, tensor_bytes
from tests.llama_quant import llama_cpp_types, write_unquantized

Q4_0, Q5_0, Q5_1, Q8_0 = QType.Q4_0, QType.Q5_0, QType.Q5_1, QType.Q8_0
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K
IQ3_S, IQ4_NL, F32 = QType.IQ3_S, QType.IQ4_NL, QType.F32
IQ3_XXS, IQ2_XXS, IQ2_S = QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_S
IQ2_XS, IQ1_S, MXFP4 = QType.IQ2_XS, QType.IQ1_S, QType.MXFP4

# --- the rules, derived by hand from llama_tensor_get_type ----------------------------------
# tiny-moe: 4 layers, 4 query / 2 KV heads (n_gqa 2), 8 experts; every row is 256 values but
# ffn_down_exps' (128, one expert's FFN width), which no 256-value type holds.
#   token_embd: the default type (the model is not tied), but IQ3_S for iq3_xxs and iq2_s,
#     Q2_K for iq2_xxs, iq2_xs and iq1_s.
#   output: Q8_0 for q8_0 (the default is Q8_0 already), Q5_K for iq3_xxs and the low-bit
#     file types (iq2_xxs, iq2_xs, iq2_s, iq1_s), Q6_K for every other.
#   attn_q: the default type (IQ2_XS for iq2_s: llama.cpp's default type for that file
#     type), but IQ2_S for iq3_xxs; ffn_gate/up_exps: the default type.
#   attn_k, attn_v: Q8_0 in every file type: "the 8-expert model" bump; the low-bit file types
#     have their own branch without the bump: Q4_K (attn_k: 8 experts; attn_v: at least 4
#     experts).
#   attn_output: Q5_K for q2_k, q3_k_m, q4_k_s, q4_k_m, iq3_s, iq3_xxs and the low-bit file
#     types (8 experts), else the default.
#   ffn_down_exps [layers 0-1, 2-3]: the ffn_down rule, then the fallback for 128 columns
#     (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, the i-quants -> IQ4_NL):
#     q2_k: Q3_K -> Q4_0; q3_k_m: Q4_K (layer < 4/16 never) -> Q5_0; iq3_xxs: Q3_K -> Q4_0;
#     q4_k_s: Q4_K (layer < 4/8 never) -> Q5_0; q4_k_m, q5_k_m: use_more_bits(i, 4) is
#     true for layers 2 ((2 - 0) % 3 == 2) and 3 (>= 7*4/8), so Q6_K -> Q8_0 there.
#   mxfp4_moe: the expert tensors (more than one expert) MXFP4, every other quantized Q8_0.
# columns: token_embd, output, attn_q, attn_k, attn_v, attn_output, ffn_gate/up_exps,
#          ffn_down_exps layers 0-1, ffn_down_exps layers 2-3
TINY_MOE = {
    "q4_0": (Q4_0, Q6_K, Q4_0, Q8_0, Q8_0, Q4_0, Q4_0, Q4_0, Q4_0),
    "q8_0": (Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0),
    "q2_k": (Q2_K, Q6_K, Q2_K, Q8_0, Q8_0, Q5_K, Q2_K, Q4_0, Q4_0),
    "q3_k_m": (Q3_K, Q6_K, Q3_K, Q8_0, Q8_0, Q5_K, Q3_K, Q5_0, Q5_0),
    "q4_k_s": (Q4_K, Q6_K, Q4_K, Q8_0, Q8_0, Q5_K, Q4_K, Q5_0, Q5_0),
    "q4_k_m": (Q4_K, Q6_K, Q4_K, Q8_0, Q8_0, Q5_K, Q4_K, Q5_0, Q8_0),
    "q5_k_s": (Q5_K, Q6_K, Q5_K, Q8_0, Q8_0, Q5_K, Q5_K, Q5_1, Q5_1),
    "q5_k_m": (Q5_K, Q6_K, Q5_K, Q8_0, Q8_0, Q5_K, Q5_K, Q5_1, Q8_0),
    "q6_k": (Q6_K, Q6_K, Q6_K, Q8_0, Q8_0, Q6_K, Q6_K, Q8_0, Q8_0),
    "iq3_s": (IQ3_S, Q6_K, IQ3_S, Q8_0, Q8_0, Q5_K, IQ3_S, IQ4_NL, IQ4_NL),
    "iq3_xxs": (IQ3_S, Q5_K, IQ2_S, Q8_0, Q8_0, Q5_K, IQ3_XXS, Q4_0, Q4_0),
    "iq2_xxs": (Q2_K, Q5_K, IQ2_XXS, Q4_K, Q4_K, Q5_K, IQ2_XXS, IQ4_NL, IQ4_NL),
    "iq2_xs": (Q2_K, Q5_K, IQ2_XS, Q4_K, Q4_K, Q5_K, IQ2_XS, IQ4_NL, IQ4_NL),
    "iq2_s": (IQ3_S, Q5_K, IQ2_XS, Q4_K, Q4_K, Q5_K, IQ2_XS, IQ4_NL, IQ4_NL),
    "iq1_s": (Q2_K, Q5_K, IQ1_S, Q4_K, Q4_K, Q5_K, IQ1_S, IQ4_NL, IQ4_NL),
    "mxfp4_moe": (Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, MXFP4, MXFP4, MXFP4),
}


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_rules_on_tiny_moe(ftype: str) -> None:
    embd, out, q, k, v, o, gate_up, down_01, down_23 = TINY_MOE[ftype]
    types = {t.name: t.qtype for t in synth.tensor_plan(synth.PRESETS["tiny-moe"], FTYPES[ftype])}
    assert types.pop("token_embd.weight") == embd
    assert types.pop("output.weight") == out
    for i in range(4):
        got = {kind: types.pop(f"blk.{i}.{kind}.weight") for kind in (
            "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps",
            "ffn_down_exps")}
        down = down_01 if i < 2 else down_23
        assert got == {"attn_q": q, "attn_k": k, "attn_v": v, "attn_output": o,
                       "ffn_gate_exps": gate_up, "ffn_up_exps": gate_up,
                       "ffn_down_exps": down}, f"layer {i}"
    # What is left is never quantized: norms (1-D) and the router (ffn_gate_inp) stay F32.
    assert set(types.values()) == {F32}
    assert sum("ffn_gate_inp" in n for n in types) == 4


# a3b: 48 layers, n_gqa 32/4 = 8, 128 experts (not 8: no bumps), every row whole 256 blocks.
# use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2, i.e. 8, 11, ..., 41.
A3B_MORE_BITS = set(range(6)) | set(range(8, 42, 3)) | set(range(42, 48))


def _a3b(ftype: str, kind: str, layer: int) -> QType | None:
    model = ModelShape("qwen3moe", n_layers=48, n_heads=32, n_kv_heads=4, n_experts=128)
    cols = 768 if kind == "ffn_down_exps" else 2048
    return tensor_type(f"blk.{layer}.{kind}.weight", (2048, cols), get_ftype(ftype), model)


def test_rules_on_a3b_layers() -> None:
    assert len(A3B_MORE_BITS) == 24
    for i in range(48):
        more = i in A3B_MORE_BITS
        # q4_k_m / q5_k_m: attn_v and ffn_down take Q6_K on use_more_bits layers.
        assert _a3b("q4_k_m", "attn_v", i) == (Q6_K if more else Q4_K)
        assert _a3b("q4_k_m", "ffn_down_exps", i) == (Q6_K if more else Q4_K)
        assert _a3b("q5_k_m", "ffn_down_exps", i) == (Q6_K if more else Q5_K)
        # q3_k_m: attn_v Q5_K on the first two attn_v tensors, Q4_K after; ffn_down Q5_K
        # below n_layer/16 = 3, Q4_K from there (not Falcon).
        assert _a3b("q3_k_m", "attn_v", i) == (Q5_K if i < 2 else Q4_K)
        assert _a3b("q3_k_m", "ffn_down_exps", i) == (Q5_K if i < 3 else Q4_K)
        # q4_k_s: attn_v Q5_K on the first four, ffn_down Q5_K below n_layer/8 = 6.
        assert _a3b("q4_k_s", "attn_v", i) == (Q5_K if i < 4 else Q4_K)
        assert _a3b("q4_k_s", "ffn_down_exps", i) == (Q5_K if i < 6 else Q4_K)
    # n_gqa >= 4: attn_v Q4_K in q2_k and iq3_s; attn_k keeps the default (not 8 experts).
    assert _a3b("q2_k", "attn_v", 0) == Q4_K and _a3b("iq3_s", "attn_v", 0) == Q4_K
    assert _a3b("q2_k", "attn_k", 0) == Q2_K and _a3b("q4_k_m", "attn_k", 0) == Q4_K
    # attn_output without 8 experts: Q3_K for q2_k, Q4_K for q3_k_m, the default otherwise.
    assert _a3b("q2_k", "attn_output", 0) == Q3_K
    assert _a3b("q3_k_m", "attn_output", 0) == Q4_K
    assert _a3b("q4_k_m", "attn_output", 0) == Q4_K and _a3b("iq3_s", "attn_output", 0) == IQ3_S
    assert _a3b("q2_k", "ffn_down_exps", 5) == Q3_K  # every layer, and 768 is 3 blocks
    assert _a3b("iq3_s", "ffn_gate_exps", 5) == IQ3_S
    # iq2_xxs (not 8 experts): attn_v Q4_K (n_gqa >= 4), ffn_down Q2_K below n_layer/8 = 6,
    # attn_k and attn_output the default.
    assert _a3b("iq2_xxs", "attn_v", 9) == Q4_K and _a3b("iq2_xxs", "attn_k", 0) == IQ2_XXS
    assert [_a3b("iq2_xxs", "ffn_down_exps", i) for i in (5, 6)] == [Q2_K, IQ2_XXS]
    assert _a3b("iq2_xxs", "attn_output", 0) == IQ2_XXS
    # iq3_xxs without an imatrix: attn_v Q4_K (n_gqa >= 4), attn_q/k IQ2_S, attn_output IQ3_S
    # (not 8 experts), ffn_down Q4_K below n_layer/8 = 6, Q3_K from there.
    assert _a3b("iq3_xxs", "attn_v", 9) == Q4_K and _a3b("iq3_xxs", "attn_k", 0) == IQ2_S
    assert _a3b("iq3_xxs", "attn_q", 3) == IQ2_S and _a3b("iq3_xxs", "attn_output", 0) == IQ3_S
    assert [_a3b("iq3_xxs", "ffn_down_exps", i) for i in (5, 6)] == [Q4_K, Q3_K]
    assert _a3b("iq3_xxs", "ffn_up_exps", 0) == IQ3_XXS
    # iq2_xs, iq2_s, iq1_s: the low-bit branch as iq2_xxs (attn_v Q4_K, ffn_down below
    # n_layer/8 = 6 raised), but iq2_s raises to IQ3_S where the others take Q2_K, and
    # attn_output (not 8 experts) is IQ3_S in iq2_s, IQ2_XXS in iq1_s; iq2_s's default IQ2_XS.
    for ftype, default, low, out in (("iq2_xs", IQ2_XS, Q2_K, IQ2_XS),
                                     ("iq2_s", IQ2_XS, IQ3_S, IQ3_S),
                                     ("iq1_s", IQ1_S, Q2_K, IQ2_XXS)):  # fmt: skip
        assert _a3b(ftype, "attn_v", 9) == Q4_K and _a3b(ftype, "attn_k", 0) == default
        assert [_a3b(ftype, "ffn_down_exps", i) for i in (5, 6)] == [low, default]
        assert _a3b(ftype, "attn_output", 0) == out
        assert _a3b(ftype, "ffn_gate_exps", 7) == default


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense", "a3b", "tiny-qwen3-next",
                                    "tiny-gpt-oss", "tiny-glm", "tiny-deepseek"])  # fmt: skip
def test_rules_match_llama_cpp(preset: str, tmp_path: Path) -> None:
    """The installed llama.cpp, asked by a dry-run quantization, picks the same types."""
    p = synth.PRESETS[preset]
    source = tmp_path / "source.gguf"
    write_unquantized(p, source)
    for name, ftype in FTYPES.items():
        theirs = llama_cpp_types(source, int(ftype.file_type), tmp_path)
        ours = {t.name: t.qtype.name for t in synth.tensor_plan(p, ftype)}
        assert ours == theirs, (preset, name, {k: (v, theirs.get(k)) for k, v in ours.items()
                                               if theirs.get(k) != v})


def test_row_length_fallbacks() -> None:
    model = ModelShape("llama", n_layers=4, n_heads=4, n_kv_heads=4)
    q4_k_m = get_ftype("Q4_K_M")
    # 96 columns: Q4_K falls back to Q5_0 (32-value blocks); 80 columns is no whole Q5_0
    # block either, so llama.cpp stores F16; output.weight takes Q8_0 (not whole Q4_K rows).
    assert tensor_type("blk.0.ffn_gate.weight", (64, 96), q4_k_m, model) == Q5_0
    assert tensor_type("blk.0.ffn_gate.weight", (64, 80), q4_k_m, model) == QType.F16
    assert tensor_type("output.weight", (64, 96), q4_k_m, model) == Q8_0
    # a 32-value type has no smaller block: F16 (llama-cpp-python 0.3.36's llama.cpp; the
    # DeepSeek preset's 48-column attn_q_b checks it against that llama.cpp's own choice)
    assert tensor_type("blk.0.ffn_gate.weight", (64, 80), get_ftype("q8_0"), model) == QType.F16
    with pytest.raises(ValueError, match="no tensor type fallback is defined for Q8_K"):
        fallback("blk.0.ffn_gate.weight", 80, QType.Q8_K)
    # a [1, H] gate (the shared expert's) is one-dimensional to ggml: kept as written
    assert tensor_type("blk.0.ffn_gate_inp_shexp.weight", (1, 256), q4_k_m, model) is None
    with pytest.raises(ValueError, match="q4_0, q8_0, q2_k"):
        get_ftype("q4_k_xl")


# --- the files -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, float]]:
    """tiny-moe in every file type (seed 0), with the seconds each took."""
    folder = tmp_path_factory.mktemp("synth-ftype")
    out = {}
    for name, ftype in FTYPES.items():
        path = folder / f"tiny-moe-{name}.gguf"
        start = time.perf_counter()
        synth.write_synth(synth.PRESETS["tiny-moe"], path, ftype=ftype)
        out[name] = (path, time.perf_counter() - start)
    return out


# Tensors already dequantized and checked, by (type, digest of their bytes): files of several
# file types share most tensors byte for byte (output.weight is the same Q6_K in nine).
_CHECKED: set[tuple[QType, bytes]] = set()


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_file_types_and_values(written: dict[str, tuple[Path, float]], ftype: str) -> None:
    path, seconds = written[ftype]
    assert seconds < 5.0
    meta, tensors = scan(path)
    assert meta["general.file_type"] == int(FTYPES[ftype].file_type)
    assert meta["strata.synth.ftype"] == ftype
    plan = synth.tensor_plan(synth.PRESETS["tiny-moe"], FTYPES[ftype])
    assert [t.name for t in tensors] == [t.name for t in plan]
    assert tensors[-1].offset + tensors[-1].nbytes <= path.stat().st_size
    for t, stored in zip(plan, tensors, strict=True):
        assert (stored.qtype, stored.shape) == (t.qtype, t.shape), t.name
        raw = tensor_bytes(path, stored)
        key = (t.qtype, hashlib.sha1(raw.tobytes()).digest())
        if key in _CHECKED:
            continue
        values = gguf_quants.dequantize(raw.reshape(t.rows, -1), t.qtype)
        assert values.shape == (t.rows, t.cols) and np.isfinite(values).all(), t.name
        if t.random_blocks:
            # The spread the preset intends for the tensor, to 3% (the smallest, attn_k,
            # has 32 K values: its sample std is within 1%).
            assert values.std() == pytest.approx(t.std, rel=0.03), t.name
            assert abs(values.mean()) < 0.02 * t.std, t.name
        _CHECKED.add(key)


def test_ftype_file_is_deterministic(
    written: dict[str, tuple[Path, float]], tmp_path: Path
) -> None:
    path, _ = written["iq3_s"]
    p = synth.PRESETS["tiny-moe"]
    again, other = tmp_path / "again.gguf", tmp_path / "other.gguf"
    synth.write_synth(p, again, ftype=get_ftype("iq3_s"))
    synth.write_synth(p, other, ftype=get_ftype("iq3_s"), seed=1)
    assert again.read_bytes() == path.read_bytes()
    assert other.read_bytes() != path.read_bytes()
    assert other.stat().st_size == path.stat().st_size


# --- llama.cpp runs them ---------------------------------------------------------------------


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_llama_cpp_generates(written: dict[str, tuple[Path, float]], ftype: str) -> None:
    path, _ = written[ftype]
    llm = llama_cpp.Llama(str(path), n_gpu_layers=0, n_ctx=64, n_threads=2, logits_all=True,
                          verbose=False, seed=0)
    prompt = llm.tokenize(b"The history of the city begins with a small fishing village")
    llm.eval(prompt)
    logits = np.asarray(llm.scores[: len(prompt)], dtype=np.float32)
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1.0).all()  # the weights carry their spread to the logits
    generated = []
    for _ in range(4):  # greedy, one token at a time
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        generated.append(token)
        llm.eval([token])
    assert len(generated) == 4 and all(0 <= t < synth.VOCAB_SIZE for t in generated)
    assert np.isfinite(np.asarray(llm.scores[: llm.n_tokens])).all()


# --- the CLI -----------------------------------------------------------------------------------


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stratactl")
    synth_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


def test_cli_ftype(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                   written: dict[str, tuple[Path, float]]) -> None:
    assert tuple(FTYPES) == synth_cli.FTYPE_NAMES
    assert tuple(synth.PRESETS) == synth_cli.PRESET_NAMES
    out = tmp_path / "m.gguf"
    # --workers changes nothing in the bytes (and starts no pool: see synth._slices).
    assert _cli(["synth", "tiny-moe", "-o", str(out), "--ftype", "Q4_K_M", "--workers", "2"]) == 0
    assert "q4_k_m" in capsys.readouterr().out
    assert out.read_bytes() == written["q4_k_m"][0].read_bytes()
    with pytest.raises(SystemExit):
        _cli(["synth", "tiny-moe", "-o", str(tmp_path / "x.gguf"), "--ftype", "q4_k_xl"])
    assert "invalid choice" in capsys.readouterr().err
    assert synth.data_nbytes(synth.PRESETS["a3b"], get_ftype("iq3_s")) < synth.data_nbytes(
        synth.PRESETS["a3b"])
