"""Bad model files give one clear error line that names the problem, never a bare traceback."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from stratad.__main__ import EXIT_BAD_MODEL
from stratad.model.graph.rope_scaling import Yarn
from stratad.model.spec import ModelError
from stratad.store.loader import load_model

H, F, V = 64, 96, 32


def _write_llama(
    path: Path, arch: str = "llama", skip: str = "", odd: str = "", scaling: str = ""
) -> None:
    """A one-layer llama GGUF; `skip` leaves a tensor out, `odd` stores one as NVFP4 (a type
    Strata does not read; zero blocks, which gguf cannot quantize into), `scaling` states
    a RoPE scaling of 4."""
    w = GGUFWriter(str(path), arch)
    if scaling:
        w.add_string(f"{arch}.rope.scaling.type", scaling)
        w.add_rope_scaling_factor(4.0)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (V, H),
        "output_norm.weight": (H,),
        "blk.0.attn_norm.weight": (H,),
        "blk.0.ffn_norm.weight": (H,),
        "blk.0.attn_q.weight": (H, H),
        "blk.0.attn_k.weight": (H // 2, H),
        "blk.0.attn_v.weight": (H // 2, H),
        "blk.0.attn_output.weight": (H, H),
        "blk.0.ffn_gate.weight": (F, H),
        "blk.0.ffn_up.weight": (F, H),
        "blk.0.ffn_down.weight": (H, F),
    }
    for name, shape in shapes.items():
        if name == skip:
            continue
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        if name == odd:
            qt = GGMLQuantizationType.NVFP4
            values_per_block, block_bytes = GGML_QUANT_SIZES[qt]
            blocks = np.zeros((shape[0], shape[1] // values_per_block * block_bytes), np.uint8)
            w.add_tensor(name, blocks, raw_dtype=qt)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    _write_llama(path)
    assert load_model(path).spec.n_layers == 1
    _write_llama(yarn := tmp_path / "yarn.gguf", scaling="yarn")  # over the stated context
    assert load_model(yarn).spec.rope_scaling == Yarn(4.0, 128, 0.1 * math.log(4.0) + 1)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown-arch", "unknown architecture 'gpt-foo'"),
        ("missing-tensor", "missing tensor 'model.layers.0.self_attn.k_proj.weight'"),
        ("unsupported-type", "tensor 'blk.0.ffn_up.weight' has type NVFP4"),
        ("unsupported-rope", "RoPE scaling 'longrope' is not supported (none, linear, yarn)"),
        ("truncated-data", "truncated: tensor data ends early"),
        ("truncated-header", "not a readable GGUF file"),
        ("absent", "no such model file"),
    ],
)
def test_bad_file_is_named(tmp_path: Path, case: str, expected: str) -> None:
    path = tmp_path / f"{case}.gguf"
    if case == "unknown-arch":
        _write_llama(path, arch="gpt-foo")
    elif case == "missing-tensor":
        _write_llama(path, skip="blk.0.attn_k.weight")
    elif case == "unsupported-type":
        _write_llama(path, odd="blk.0.ffn_up.weight")
    elif case == "unsupported-rope":
        _write_llama(path, scaling="longrope")
    elif case.startswith("truncated"):
        _write_llama(tmp_path / "full.gguf")
        data = (tmp_path / "full.gguf").read_bytes()
        path.write_bytes(data[: len(data) - 1000] if case == "truncated-data" else data[:100])
    with pytest.raises(ModelError) as info:
        load_model(path)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_daemon_reports_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    _write_llama(path, odd="blk.0.ffn_up.weight")
    proc = subprocess.run(
        [sys.executable, "-m", "stratad", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # a model that cannot be served as it is: the exit code the unit never restarts
    assert proc.returncode == EXIT_BAD_MODEL
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "has type NVFP4" in errors[0], proc.stderr


def test_bad_config_is_named(tmp_path: Path) -> None:
    config = tmp_path / "stratad.toml"
    config.write_text("[server]\nprot = 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "stratad", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown field `prot`" in proc.stderr and "Traceback" not in proc.stderr


def test_prefetch_without_the_copy_path_is_refused_at_parse() -> None:
    from stratad.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match='expert_prefetch needs gpu_miss = "copy"'):
        parse_config('[engine]\nexpert_prefetch = true\ngpu_miss = "in_place"\n', "s.toml")
    assert parse_config("[engine]\nexpert_prefetch = true\n").engine.expert_prefetch
    # auto (the default) is decided with the miss path (tests/test_switches.py)
    assert parse_config("").engine.expert_prefetch == "auto"


def _stratad(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stratad", *args, "--control-socket", ""],
                          capture_output=True, text=True, timeout=180)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "server.port: expected int <= 65535"),
        (["--max-context", "0"], "model.max_context: expected int >= 2"),
    ],
)
def test_start_up_config_errors_are_one_line(args: list[str], message: str) -> None:
    proc = _stratad(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"stratad: {message}"


def test_a_port_it_cannot_take_is_one_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = _stratad("--port", str(port))
    unknown = _stratad("--host", "no-such-host.invalid", "--port", "0")
    for proc, needle in ((busy, "address already in use"), (unknown, "no-such-host.invalid")):
        errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert len(errors) == 1 and "cannot listen on" in errors[0] and needle in errors[0]


def test_a_config_json_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    proc = _stratad(str(model), "--port", "0")
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert proc.returncode == EXIT_BAD_MODEL and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "not UTF-8 text" in errors[0]


def test_top_k_as_a_whole_float() -> None:
    """JSON Schema's integer admits 0.0: top_k 0.0 and 3.0 are taken, 2.5 refused by name."""
    import msgspec

    from stratad.server.openai import requests as oa

    def top_k(raw: bytes) -> int:
        body = b'{"prompt": "x", "top_k": ' + raw + b"}"
        return oa.completion_jobs(msgspec.json.decode(body, type=oa.CompletionRequest))[0].top_k

    assert (top_k(b"0.0"), top_k(b"3.0"), top_k(b"5")) == (0, 3, 5)
    with pytest.raises(oa.RequestError, match="top_k must be a whole number, not 2.5"):
        top_k(b"2.5")


# --- lying GGUF headers: what a file states checked against the file and the architecture


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_store_fakes import tiny_moe_gguf

    return tiny_moe_gguf(tmp_path_factory)


def _lying(src: Path, dst: Path, tensor: str | None, part: int, value: int,
           field: str | None = None) -> Path:  # fmt: skip
    """A copy of `src` with one number of its header changed: part `part` of a tensor's info
    (2 dims count, 3 dims, 4 type, 5 offset; a negative value adds to the number), or the
    metadata `field`."""
    import shutil

    from gguf import GGUFReader

    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    if field is not None:
        at = reader.fields[field].parts[-1]
    else:
        at = next(t for t in reader.tensors if t.name == tensor).field.parts[part]
    at[0] = value if value >= 0 else int(at[0]) - value
    reader.data.flush()
    return dst


LIES = [  # (model, what, tensor, part, value, field, the error names)
    ("moe", "Q4_0 stated as F32", "blk.1.ffn_gate_exps.weight", 4, 0, None, "overlap"),
    ("moe", "16 experts stated, 8 held", None, 0, 16, "qwen3moe.expert_count", "router of layer"),
    ("moe", "top-99 of 8", None, 0, 99, "qwen3moe.expert_used_count", "top-99"),
    # the rest on the one-layer llama file: no tokenizer to parse (seconds on tiny-moe's)
    ("llama", "offset moved by a byte", "blk.0.attn_output.weight", 5, -1, None, "alignment"),
    ("llama", "context length 0", None, 0, 0, "llama.context_length", "context length is 0"),
    ("llama", "no attention heads", None, 0, 0, "llama.attention.head_count", "heads is 0"),
    ("llama", "a billion layers", None, 0, 10**9, "llama.block_count", "1,000,000,000 layers"),
    ("llama", "2 layers stated, 1 held", None, 0, 2, "llama.block_count", "states 2 layers"),
]


@pytest.mark.parametrize(("model", "what", "tensor", "part", "value", "field", "named"), LIES,
                         ids=[c[1] for c in LIES])  # fmt: skip
def test_lying_header_is_one_line(
    tiny_gguf: Path, tmp_path: Path, model: str, what: str, tensor: str | None, part: int,
    value: int, field: str | None, named: str,
) -> None:  # fmt: skip
    """Each lie was a SIGSEGV or SIGABRT in native code after "loaded", or a traceback; now
    the load refuses it in one line naming it, before any byte is read through it."""
    src = tiny_gguf
    if model == "llama":
        src = tmp_path / "llama.gguf"
        _write_llama(src)
    path = _lying(src, tmp_path / "lying.gguf", tensor, part, value, field)
    with pytest.raises(ModelError) as info:
        load_model(path)
    assert named in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_lying_header_fails_the_check_and_the_daemon(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stratactl check` runs the daemon's checks (it passed these files), and the daemon
    exits with the code the unit never restarts, one ERROR line."""
    import json

    from stratactl.__main__ import main as stratactl

    path = _lying(tiny_gguf, tmp_path / "lying.gguf", "blk.1.ffn_gate_exps.weight", 4, 0)
    config = tmp_path / "check.toml"
    config.write_text(f'[model]\npath = "{path}"\n[engine]\ndevice = "cpu"\n')
    capsys.readouterr()
    assert stratactl(["check", "--json", "--config", str(config)]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["model"]["status"] == "fail" and "overlap" in checks["model"]["detail"]
    proc = subprocess.run([sys.executable, "-m", "stratad", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_BAD_MODEL and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "overlap" in errors[0], proc.stderr


def test_header_fuzz_loads_or_refuses_in_one_line(tmp_path: Path) -> None:
    """A mutation loop over a header's numbers (tensors' dims, type and offset, the
    architecture's counts): every variant loads or is refused with one line; no other
    exception, no signal (the test process would die). On the one-layer llama file: no
    tokenizer to parse, so each load takes milliseconds."""
    from gguf import GGUFReader

    path = tmp_path / "fuzz.gguf"
    _write_llama(path)
    reader = GGUFReader(path, "r+")
    targets = []
    for t in reader.tensors:
        p = t.field.parts
        targets += [(p[5], [int(p[5][0]) + 32, int(p[5][0]) + 4, 2**40]),
                    (p[4], [1, 2, 8, 14, 200]), (p[3], [0, int(p[3][0]) * 2, 2**40]),
                    (p[2], [0, 3])]  # fmt: skip
    for name in ("llama.embedding_length", "llama.attention.head_count_kv",
                 "llama.feed_forward_length", "llama.block_count", "llama.context_length",
                 "llama.attention.head_count"):  # fmt: skip
        targets.append((reader.fields[name].parts[-1], [0, 1, 3, 2**31]))
    outcomes = []
    for at, values in targets:
        old = int(at[0])
        for value in values:
            at[0] = value
            reader.data.flush()
            try:
                load_model(path)
                outcomes.append("loaded")
            except ModelError as e:
                assert "\n" not in str(e), str(e)
                outcomes.append("refused")
        at[0] = old
        reader.data.flush()
    assert outcomes.count("refused") > len(outcomes) // 2, outcomes
