"""Dense weights of the types only `kernels.formats.quant` reads (no fused kernel) through the
loader and the reference engine: the same logits as the file with those weights stored as F32 values
that gguf-py dequantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf import quants as gguf_quants

from kernels.formats.quant import QType, block_geometry, row_bytes
from stratad.engine.reference.forward import ReferenceForward
from stratad.store.loader import load_model
from tests.test_quant import FP16_FIELDS

H, F, V = 256, 256, 32  # 256 columns: one super-block per row for the K- and i-quants
MATRICES = {
    "blk.0.attn_q.weight": (H, H),
    "blk.0.attn_k.weight": (H // 2, H),
    "blk.0.attn_v.weight": (H // 2, H),
    "blk.0.attn_output.weight": (H, H),
    "blk.0.ffn_gate.weight": (F, H),
    "blk.0.ffn_up.weight": (F, H),
    "blk.0.ffn_down.weight": (H, F),
}
TYPES = [
    QType.Q5_0,
    QType.Q5_1,
    QType.Q2_K,
    QType.Q3_K,
    QType.IQ4_NL,
    QType.IQ4_XS,
    QType.IQ3_S,
    QType.IQ3_XXS,
    QType.IQ2_S,
    QType.IQ2_XS,
    QType.IQ2_XXS,
    QType.IQ1_S,
    QType.MXFP4,
]


def _small_blocks(qtype: QType, rows: int, cols: int, gen: torch.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quants, fp16 fields (MXFP4: scales) of magnitude
    2^-14..2^-10 (so the weights stay small enough for finite logits)."""
    n = rows * cols // block_geometry(qtype)[0]
    raw = torch.randint(0, 256, (n, block_geometry(qtype)[1]), generator=gen, dtype=torch.uint8)
    for offset in FP16_FIELDS[qtype]:
        magnitude = 2.0 ** torch.empty(n).uniform_(-14, -10, generator=gen)
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        field = (sign * magnitude).half().view(torch.uint8).reshape(n, 2)
        raw[:, offset : offset + 2] = field
    if qtype == QType.MXFP4:  # E8M0 exponents e: scales 2^(e - 128)
        raw[:, 0] = torch.randint(114, 119, (n,), generator=gen, dtype=torch.uint8)
    return raw.reshape(rows, row_bytes(qtype, cols)).numpy()


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, QType]]) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    for name, (data, qtype) in tensors.items():
        if qtype == QType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_engine_on_dense_weights_of_type(tmp_path: Path, qtype: QType) -> None:
    gen = torch.Generator().manual_seed(int(qtype))
    rng = np.random.default_rng(int(qtype))
    common = {
        "token_embd.weight": (rng.standard_normal((V, H)).astype(np.float32), QType.F32),
        "output_norm.weight": (np.ones(H, dtype=np.float32), QType.F32),
        "blk.0.attn_norm.weight": (np.ones(H, dtype=np.float32), QType.F32),
        "blk.0.ffn_norm.weight": (np.ones(H, dtype=np.float32), QType.F32),
    }
    blocks = {name: _small_blocks(qtype, *shape, gen) for name, shape in MATRICES.items()}
    typed = common | {name: (b, qtype) for name, b in blocks.items()}
    as_f32 = common | {
        name: (gguf_quants.dequantize(b, qtype), QType.F32) for name, b in blocks.items()
    }
    _write(tmp_path / "typed.gguf", typed)
    _write(tmp_path / "f32.gguf", as_f32)

    logits = []
    for path in (tmp_path / "typed.gguf", tmp_path / "f32.gguf"):
        model = load_model(path)
        forward = ReferenceForward(model)
        logits.append(forward([1, 5, 9, 3], forward.new_cache(16), all_logits=True))
        up = model.tensor("model.layers.0.mlp.up_proj.weight")
        assert up.qtype == (qtype if path.name == "typed.gguf" else QType.F32)
    ours, expected = logits
    assert ours.shape == (4, V) and torch.isfinite(ours).all()
    assert ours.std() > 0  # the weights reached the logits
    assert torch.equal(ours, expected)
