"""Random valid GGUF blocks (`stratad.model.synthetic.blocks`), read back by gguf-py's
dequantizers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from stratad.model.synthetic.blocks import BLOCK_TYPES, random_blocks

N_VALUES = 1 << 18  # 1024 super-blocks, 8192 32-value blocks


@pytest.mark.parametrize("name", sorted(q.name for q in BLOCK_TYPES))
@pytest.mark.parametrize("std", [0.02, 1.5])
def test_blocks_have_the_intended_spread(name: str, std: float) -> None:
    qtype = QType[name]
    blocks = random_blocks(qtype, N_VALUES, std, seed=7)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    assert blocks.dtype == np.uint8 and blocks.shape == (N_VALUES // block, nbytes)
    values = gguf_quants.dequantize(blocks, qtype).reshape(-1)
    assert values.shape == (N_VALUES,) and np.isfinite(values).all()
    assert values.std() == pytest.approx(std, rel=0.02)
    assert abs(values.mean()) < 0.01 * std
    # Not a constant per block: the quants vary inside every block.
    assert (values.reshape(-1, block).std(axis=1) > 0).all()


@pytest.mark.parametrize("name", ["Q4_K", "IQ3_S", "Q8_0", "IQ2_XXS", "MXFP4"])
def test_blocks_are_deterministic_in_the_seed(name: str) -> None:
    qtype = QType[name]
    one = random_blocks(qtype, 4096, 0.1, seed=1)
    assert np.array_equal(one, random_blocks(qtype, 4096, 0.1, seed=1))
    assert not np.array_equal(one, random_blocks(qtype, 4096, 0.1, seed=2))


def test_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        random_blocks(QType.Q4_K, 128, 0.1, seed=0)
    with pytest.raises(ValueError, match="no random block writer for IQ1_M"):
        random_blocks(QType.IQ1_M, 256, 0.1, seed=0)
    with pytest.raises(ValueError, match="fp16 block scale"):
        random_blocks(QType.Q8_0, 32, 1e-12, seed=0)
    with pytest.raises(ValueError, match="MXFP4 block scale"):
        random_blocks(QType.MXFP4, 32, 1e-40, seed=0)
