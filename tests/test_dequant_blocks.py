"""kernels/formats/dequant_blocks.py: many matrices of GGUF blocks dequantized in one launch, bit
for bit against the torch dequantization (`kernels.formats.quant.dequantize`) in each output
dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.formats.dequant_blocks import BlocksConfig, dequant_blocks, dequant_blocks_ref
from kernels.formats.quant import QType, block_geometry, quantize, row_bytes

CASES = [
    (QType.Q4_K, 5, 256),
    (QType.Q6_K, 3, 512),
    (QType.Q8_0, 4, 96),
    (QType.Q4_1, 7, 64),
    (QType.Q5_K, 2, 256),
    (QType.Q5_0, 3, 64),
]


@pytest.mark.parametrize(("qtype", "rows", "cols"), CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_dequantization(
    qtype: QType, rows: int, cols: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    n = 3
    blocks = quantize(torch.randn(n, rows, cols, generator=gen), qtype)  # [n, rows, bytes]
    # a column slice of a wider buffer, as the engine's blobs hold each projection
    wide = torch.zeros(n, rows * blocks.shape[-1] + 48, dtype=torch.uint8)
    wide[:, 16 : 16 + rows * blocks.shape[-1]] = blocks.reshape(n, -1)
    sections = wide[:, 16 : 16 + rows * blocks.shape[-1]]
    got = dequant_blocks(sections, qtype, rows, cols, dtype, BlocksConfig(block_r=4, block_c=64))
    want = dequant_blocks_ref(sections, qtype, rows, cols).to(dtype)
    assert torch.equal(got, want)


def test_refuses_a_wrong_size() -> None:
    with pytest.raises(ValueError, match="takes"):
        dequant_blocks(torch.zeros(2, 100, dtype=torch.uint8), QType.Q8_0, 2, 64, torch.float32)


# where each type without a quantizer here keeps its fp16 fields (MXFP4 has none: any byte is
# an E8M0 exponent, the subnormal and overflowing scales included)
FP16_AT = {QType.IQ3_S: [0], QType.IQ4_XS: [0], QType.IQ4_NL: [0], QType.Q2_K: [80, 82],
           QType.Q3_K: [108], QType.IQ3_XXS: [0], QType.IQ2_XXS: [0], QType.IQ2_XS: [0],
           QType.IQ2_S: [0], QType.IQ1_S: [0], QType.MXFP4: []}  # fmt: skip


def _random_blocks(qtype: QType, n: int, rows: int, cols: int) -> torch.Tensor:
    """uint8 [n, rows * row bytes]: random blocks with finite fp16 fields."""
    gen = torch.Generator().manual_seed(6)
    raw = torch.randint(0, 256, (n, rows * row_bytes(qtype, cols)), generator=gen)
    raw = raw.to(torch.uint8)
    blocks = raw.view(-1, block_geometry(qtype)[1])
    for at in FP16_AT[qtype]:
        half = torch.rand(blocks.shape[0], generator=gen).half()
        blocks[:, at : at + 2] = half.view(torch.uint8).view(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", list(FP16_AT), ids=lambda q: q.name)
def test_random_blocks(qtype: QType) -> None:
    """The types without a quantizer here: random blocks with finite fp16 fields."""
    raw = _random_blocks(qtype, 2, 3, 256)
    got = dequant_blocks(raw, qtype, 3, 256, torch.bfloat16, BlocksConfig(block_r=2, block_c=128))
    assert torch.equal(got, dequant_blocks_ref(raw, qtype, 3, 256).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "qtype", [QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S],
    ids=lambda q: q.name,
)  # fmt: skip
def test_random_blocks_gpu(qtype: QType) -> None:
    """The low-bit i-quants at an expert's shape on a GPU, bit for bit in bfloat16."""
    raw = _random_blocks(qtype, 4, 768, 2048)
    got = dequant_blocks(raw.cuda(), qtype, 768, 2048, torch.bfloat16)
    assert torch.equal(got.cpu(), dequant_blocks_ref(raw, qtype, 768, 2048).to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the inf is meant
def test_mxfp4_columns_past_a_whole_tile() -> None:
    """MXFP4 decoded eight blocks a program: 10 blocks a row (gpt-oss's 2,880 columns are 90)
    leave the second program two, the rest masked; bit for bit in bfloat16."""
    raw = _random_blocks(QType.MXFP4, 2, 3, 320)
    got = dequant_blocks(raw, QType.MXFP4, 3, 320, torch.bfloat16, BlocksConfig(block_r=2))
    assert torch.equal(got, dequant_blocks_ref(raw, QType.MXFP4, 3, 320).to(torch.bfloat16))


def test_mxfp4_every_exponent() -> None:
    """MXFP4 blocks with each of the 256 E8M0 exponents (0 and 1 scale by subnormals, the top
    ones overflow the larger levels to inf), bit for bit in float32."""
    raw = _random_blocks(QType.MXFP4, 1, 32, 256)  # 256 blocks of 17 bytes
    raw.view(-1, 17)[:, 0] = torch.arange(256, dtype=torch.uint8)
    got = dequant_blocks(raw, QType.MXFP4, 32, 256, torch.float32, BlocksConfig(block_r=8))
    want = dequant_blocks_ref(raw, QType.MXFP4, 32, 256)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert want.isinf().any() and (want.abs() == 2.0**-128).any()
