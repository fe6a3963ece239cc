"""kernels.formats.quant: torch dequantizers bit-exact with gguf-py (a port of llama.cpp's
dequantize_row_*), quantizers, QTensor, and the refusal of unsupported types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

from kernels.formats.quant import (
    FLOAT_QTYPES,
    QUANTIZE_QTYPES,
    SUPPORTED_QTYPES,
    QTensor,
    QType,
    UnsupportedTensorType,
    block_geometry,
    dequantize,
    quantize,
    row_bytes,
)

QUANTIZED = sorted(SUPPORTED_QTYPES - FLOAT_QTYPES, key=lambda t: t.name)
WRITABLE = sorted(QUANTIZE_QTYPES, key=lambda t: t.name)
READ_ONLY = sorted(SUPPORTED_QTYPES - FLOAT_QTYPES - QUANTIZE_QTYPES, key=lambda t: t.name)

# Byte offsets of the fp16 scale fields in each block: random bytes there could be inf/NaN,
# which llama.cpp files never hold, so the tests overwrite them with random finite halves.
# MXFP4 has none: its scale is an E8M0 exponent byte, and every byte is one.
FP16_FIELDS: dict[QType, list[int]] = {
    QType.Q8_0: [0],
    QType.Q4_0: [0],
    QType.Q4_1: [0, 2],
    QType.Q5_0: [0],
    QType.Q5_1: [0, 2],
    QType.Q2_K: [80, 82],
    QType.Q3_K: [108],
    QType.Q4_K: [0, 2],
    QType.Q5_K: [0, 2],
    QType.Q6_K: [208],
    QType.IQ4_NL: [0],
    QType.IQ4_XS: [0],
    QType.IQ3_S: [0],
    QType.IQ3_XXS: [0],
    QType.IQ2_S: [0],
    QType.IQ2_XS: [0],
    QType.IQ2_XXS: [0],
    QType.IQ1_S: [0],
    QType.MXFP4: [],
}


def random_finite_fp16(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, 2] uint8: random fp16 bit patterns (zeros, subnormals, negatives), never inf/NaN."""
    bits = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    exponent_all_ones = (bits & 0x7C00) == 0x7C00
    bits = torch.where(exponent_all_ones, bits & ~0x4000, bits)
    return bits.to(torch.int16).view(torch.uint8).reshape(n, 2)


def random_blocks(qtype: QType, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random quants and scales, finite fp16 fields."""
    gen = torch.Generator().manual_seed(seed)
    _, nbytes = block_geometry(qtype)
    n_blocks = rows * cols // block_geometry(qtype)[0]
    raw = torch.randint(0, 256, (n_blocks, nbytes), generator=gen, dtype=torch.uint8)
    for offset in FP16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = random_finite_fp16(n_blocks, gen)
    return raw.reshape(rows, row_bytes(qtype, cols))


def gguf_dequantize(raw: torch.Tensor, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), qtype)))


def test_fp16_fields_cover_every_quantized_type() -> None:
    assert set(FP16_FIELDS) == set(QUANTIZED)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7])
def test_dequantize_bit_exact_with_gguf(qtype: QType, rows: int) -> None:
    block, _ = block_geometry(qtype)
    cols = 3 * block
    raw = random_blocks(qtype, rows, cols, seed=rows)
    ours = dequantize(raw, qtype, (rows, cols))
    expected = gguf_dequantize(raw, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    # Compare bit patterns, so that -0.0 vs 0.0 or a different NaN would also fail.
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


# The types added to the first nine: each on ragged shapes (one block, rows of two blocks,
# an expert stack), against gguf-py.
NEW_QTYPES = sorted(
    {QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS, QType.IQ3_S}
    | {QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.MXFP4},
    key=lambda t: t.name,
)


@pytest.mark.parametrize("qtype", NEW_QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "blocks_shape", [(1, 1), (5, 2), (2, 3, 1)], ids=lambda s: "x".join(map(str, s))
)
def test_new_type_on_ragged_shapes(qtype: QType, blocks_shape: tuple[int, ...]) -> None:
    """blocks_shape is the shape in blocks: the last dimension counts blocks per row."""
    block, _ = block_geometry(qtype)
    shape = (*blocks_shape[:-1], blocks_shape[-1] * block)
    rows = int(np.prod(shape[:-1]))
    raw = random_blocks(qtype, rows, shape[-1], seed=sum(blocks_shape)).reshape(*shape[:-1], -1)
    ours = dequantize(raw, qtype, shape)
    expected = gguf_dequantize(raw, qtype).reshape(shape)
    assert ours.shape == shape
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


def test_mxfp4_edge_exponents_bit_exact_with_gguf() -> None:
    """MXFP4's E8M0 exponent byte at its edges, each block holding every 4-bit code: e = 0 and
    1 scale by the subnormals 2^-128 and 2^-127, e = 255 by 2^127 (its larger levels overflow
    to inf in float32, in gguf-py as here)."""
    gen = torch.Generator().manual_seed(9)
    exponents = torch.tensor([0, 1, 2, 127, 128, 253, 254, 255], dtype=torch.uint8)
    codes = torch.randint(0, 256, (len(exponents), 16), generator=gen, dtype=torch.uint8)
    codes[:, :8] = torch.arange(0, 16, 2, dtype=torch.uint8) | (torch.arange(1, 16, 2) << 4)
    raw = torch.cat([exponents[:, None], codes], dim=1)  # [8 blocks, 17 bytes]
    ours = dequantize(raw, QType.MXFP4, (len(exponents), 32))
    with np.errstate(over="ignore"):  # the inf is meant
        expected = gguf_dequantize(raw, QType.MXFP4)
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))
    # values 0..15 are codes 0, 2, .., 14 and values 16..31 codes 1, 3, .., 15
    assert ours[0, 16].item() == 2.0**-128  # code 1 (level 1) at e = 0: no flush to zero
    assert ours[1, 16].item() == 2.0**-127 and ours[3, 16].item() == 0.5
    assert ours[7, 16].item() == 2.0**127 and ours[7, 23].item() == float("-inf")  # 1, -12


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2])
def test_dequantize_unaligned_storage(qtype: QType, rows: int) -> None:
    """Blocks at an odd byte offset (as in a mmapped file) decode the same; one block alone
    is the case where a field's slice is contiguous at that odd offset."""
    raw = random_blocks(qtype, rows, block_geometry(qtype)[0], seed=3)
    buf = torch.empty(raw.numel() + 1, dtype=torch.uint8)
    buf[1:] = raw.reshape(-1)
    shifted = buf[1:].reshape(raw.shape)
    shape = (rows, block_geometry(qtype)[0])
    assert torch.equal(dequantize(shifted, qtype, shape), dequantize(raw, qtype, shape))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_qtensor_slices_an_expert_stack(qtype: QType) -> None:
    experts, rows, cols = 3, 4, block_geometry(qtype)[0] * 2
    raw = random_blocks(qtype, experts * rows, cols, seed=5).reshape(experts, rows, -1)
    qt = QTensor(raw, qtype, (experts, rows, cols))
    full = qt.dequantize()
    assert full.shape == (experts, rows, cols)
    one = qt[1]
    assert one.shape == (rows, cols) and one.qtype == qtype and not one.is_float
    assert one.nbytes == rows * row_bytes(qtype, cols)
    assert torch.equal(one.dequantize(), full[1])
    assert one.dequantize(torch.float16).dtype == torch.float16


@pytest.mark.parametrize(
    ("qtype", "dtype"),
    [(QType.F32, torch.float32), (QType.F16, torch.float16), (QType.BF16, torch.bfloat16)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_float_types(qtype: QType, dtype: torch.dtype) -> None:
    values = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    qt = QTensor(values, qtype, (2, 3, 8))
    assert qt.is_float and qt.nbytes == values.numel() * values.element_size()
    assert torch.equal(qt.dequantize(), values.float())
    assert torch.equal(qt[1].dequantize(), values[1].float())
    # Raw little-endian bytes, as read from a file, decode to the same values.
    raw = values.contiguous().view(torch.uint8)
    assert torch.equal(dequantize(raw, qtype, (2, 3, 8)), values.float())


def test_bf16_matches_gguf() -> None:
    values = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    raw = values.view(torch.uint8)
    expected = gguf_dequantize(raw, QType.BF16).reshape(4, 16)
    assert torch.equal(dequantize(raw, QType.BF16, (4, 16)), expected)


@pytest.mark.parametrize(
    "qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1], ids=lambda t: t.name
)
def test_quantize_matches_gguf_reference(qtype: QType) -> None:
    values = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    ours = quantize(values, qtype)
    assert ours.dtype == torch.uint8 and ours.shape == (2, 3, row_bytes(qtype, 64))
    expected = gguf_quants.quantize(values.numpy(), qtype)
    assert np.array_equal(ours.numpy(), expected)


# Worst-case |x - dequant(quant(x))| as a fraction of the block's absolute maximum: half a
# quantization step plus fp16 rounding of the stored scales (and, for the K-quants, the
# 6-bit rounding of the sub-block scales).
ROUND_TRIP_BOUND: dict[QType, float] = {
    QType.Q8_0: 0.5 / 127 * 1.1,
    QType.Q4_0: 1 / 8 * 1.01,
    QType.Q4_1: 2 * 0.5 / 15 * 1.1,
    # Q5_0 as Q4_0: the block's extreme maps to -16 d, its opposite clips at 15 d
    QType.Q5_0: 1 / 16 * 1.01,
    QType.Q5_1: 2 * 0.5 / 31 * 1.1,
    QType.Q4_K: 2 * 0.5 / 15 * 1.5,
    QType.Q5_K: 2 * 0.5 / 31 * 1.5,
    QType.Q6_K: 0.5 / 31 * 1.5,
}


def test_round_trip_bounds_cover_every_writable_type() -> None:
    assert set(ROUND_TRIP_BOUND) == set(WRITABLE)


@pytest.mark.parametrize("qtype", WRITABLE, ids=lambda t: t.name)
def test_round_trip_error_bound(qtype: QType) -> None:
    block, _ = block_geometry(qtype)
    values = torch.randn(5, 2 * block, generator=torch.Generator().manual_seed(4))
    values[0, :block] = 0.0  # an all-zero block must survive (scale 0, no division by it)
    decoded = dequantize(quantize(values, qtype), qtype, tuple(values.shape))
    assert torch.equal(decoded[0, :block], torch.zeros(block))
    err = (decoded - values).abs().reshape(-1, block).amax(dim=-1)
    absmax = values.abs().reshape(-1, block).amax(dim=-1)
    assert torch.all(err <= ROUND_TRIP_BOUND[qtype] * absmax), (err / absmax).max()


@pytest.mark.parametrize("qtype", [QType.IQ1_M, QType.TQ2_0, QType.NVFP4], ids=lambda t: t.name)
def test_unsupported_type_is_refused_by_name(qtype: QType) -> None:
    raw = torch.zeros(1, 64, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorType, match=qtype.name):
        dequantize(raw, qtype, (1, 256))
    with pytest.raises(UnsupportedTensorType, match=qtype.name):
        quantize(torch.zeros(1, 256), qtype)


@pytest.mark.parametrize("qtype", READ_ONLY, ids=lambda t: t.name)
def test_quantize_refuses_a_type_it_only_reads(qtype: QType) -> None:
    block, _ = block_geometry(qtype)
    with pytest.raises(ValueError, match=f"cannot write {qtype.name} blocks"):
        quantize(torch.zeros(2, block), qtype)


def test_shape_mismatch_is_an_error() -> None:
    raw = random_blocks(QType.Q8_0, 2, 64)
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(raw, QType.Q8_0, (2, 96))
    with pytest.raises(ValueError, match="multiple"):
        quantize(torch.zeros(2, 40), QType.Q8_0)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_dequantize_on_gpu_matches_cpu(qtype: QType) -> None:
    raw = random_blocks(qtype, 64, 4 * block_geometry(qtype)[0], seed=9)
    shape = (64, 4 * block_geometry(qtype)[0])
    on_gpu = dequantize(raw.cuda(), qtype, shape)
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), dequantize(raw, qtype, shape))
