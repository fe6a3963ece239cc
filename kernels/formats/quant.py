"""GGUF block formats: the quantized tensor type and its bit-exact dequantization.

A `QTensor` keeps a weight as GGUF stores it (raw blocks, row-major, one row of blocks per output
row) so that kernels can read the blocks directly; `dequantize()` gives the float32 values exactly
as llama.cpp computes them, in pure torch so it runs where the blocks already are (CPU or GPU). The
K-quants (256-value super-blocks) live in `kernels/formats/quant_k.py`, the i-quants (lattice
codebooks) and MXFP4 (a level table, as IQ4_NL) in `kernels/formats/quant_iq.py`; this file owns
the types, the dispatch and the 32-value formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).

`quantize()` writes blocks of the `QUANTIZE_QTYPES`, for building synthetic models and test
fixtures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kernels.formats import quant_iq, quant_k
from kernels.formats.quant_fields import fp16, nibbles, split_bits

QType = GGMLQuantizationType

# The tensor types Strata reads. Anything else is refused at load with the tensor's name.
SUPPORTED_QTYPES: frozenset[QType] = frozenset(
    {
        QType.F32,
        QType.F16,
        QType.BF16,
        QType.Q8_0,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q2_K,
        QType.Q3_K,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
        QType.IQ4_NL,
        QType.IQ4_XS,
        QType.IQ3_S,
        QType.IQ3_XXS,
        QType.IQ2_S,
        QType.IQ2_XS,
        QType.IQ2_XXS,
        QType.IQ1_S,
        QType.MXFP4,
    }
)
FLOAT_QTYPES: frozenset[QType] = frozenset({QType.F32, QType.F16, QType.BF16})
_FLOAT_DTYPES: dict[QType, torch.dtype] = {
    QType.F32: torch.float32,
    QType.F16: torch.float16,
    QType.BF16: torch.bfloat16,
}


class UnsupportedTensorType(ValueError):
    """A tensor's GGUF type is not one Strata reads."""


def block_geometry(qtype: QType) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: QType, cols: int) -> int:
    block, nbytes = block_geometry(qtype)
    if cols % block:
        raise ValueError(f"{cols} columns is not a multiple of the {qtype.name} block ({block})")
    return cols // block * nbytes


@dataclass(frozen=True)
class QTensor:
    """A weight in its GGUF encoding.

    `data` is a uint8 tensor [*rows, row_bytes] of raw blocks for quantized types and a
    float tensor of `shape` for F32/F16/BF16. `shape` is the logical torch shape
    (rows..., cols), i.e. GGUF's dimensions reversed.
    """

    data: torch.Tensor
    qtype: QType
    shape: tuple[int, ...]

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_QTYPES

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __getitem__(self, index: int) -> QTensor:
        """The index-th slice along the first dimension (e.g. one expert of a stack)."""
        return QTensor(self.data[index], self.qtype, self.shape[1:])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.qtype, self.shape).to(dtype)


# --- 32-value block formats ---------------------------------------------------------------
# Each takes blocks [n, bytes per block] (uint8) and returns values [n, 32] (float32).
# The arithmetic order follows llama.cpp's dequantize_row_* (float32 from the fp16 scale,
# one multiply, then the offset) so the results are bit-identical, not merely close.


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    q = blocks[:, 2:].view(torch.int8).float()  # [n, 32]
    return q * d


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    q = nibbles(blocks[:, 2:]).to(torch.int8) - 8  # [n, 32]
    return d * q.float()


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    m = fp16(blocks[:, 2:4])  # [n, 1]
    q = nibbles(blocks[:, 4:]).float()  # [n, 32]
    return d * q + m


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 quants: qh [n, 4] (bit j of the little-endian uint32 is value j's 5th bit)
    and qs [n, 16] (the low 4 bits, as Q4_0) -> [n, 32] uint8 in 0..31."""
    hi = split_bits(qh, 8, 1).reshape(-1, 32)  # [n, 32]: byte j // 8, bit j % 8
    return nibbles(qs) | (hi << 4)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    q = _five_bits(blocks[:, 2:6], blocks[:, 6:]).to(torch.int8) - 16  # [n, 32]
    return d * q.float()


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d = fp16(blocks[:, :2])  # [n, 1]
    m = fp16(blocks[:, 2:4])  # [n, 1]
    q = _five_bits(blocks[:, 4:8], blocks[:, 8:]).float()  # [n, 32]
    return d * q + m


_DEQUANTIZERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _dequant_q8_0,
    QType.Q4_0: _dequant_q4_0,
    QType.Q4_1: _dequant_q4_1,
    QType.Q5_0: _dequant_q5_0,
    QType.Q5_1: _dequant_q5_1,
    QType.Q2_K: quant_k.dequant_q2_k,
    QType.Q3_K: quant_k.dequant_q3_k,
    QType.Q4_K: quant_k.dequant_q4_k,
    QType.Q5_K: quant_k.dequant_q5_k,
    QType.Q6_K: quant_k.dequant_q6_k,
    **quant_iq.DEQUANTIZERS,
}


def _check_supported(qtype: QType) -> None:
    if qtype not in SUPPORTED_QTYPES:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorType(f"tensor type {name} is not supported")


def dequantize(data: torch.Tensor, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values [*shape] of raw GGUF data, bit-exact with llama.cpp's dequantization.

    `data` is uint8 blocks [*rows, row_bytes] for quantized types (any shape with the right
    byte count), and for float types either the float tensor or its raw bytes. The result
    is on `data`'s device.
    """
    _check_supported(qtype)
    if qtype in FLOAT_QTYPES:
        if data.dtype == torch.uint8:
            data = data.contiguous().view(_FLOAT_DTYPES[qtype])
        return data.reshape(shape).float()
    if data.dtype != torch.uint8:
        raise TypeError(f"{qtype.name} data must be uint8 blocks, got {data.dtype}")
    block, nbytes = block_geometry(qtype)
    numel = 1
    for dim in shape:
        numel *= dim
    if shape and shape[-1] % block or data.numel() * block != numel * nbytes:
        raise ValueError(
            f"{data.numel()} bytes of {qtype.name} do not hold a tensor of shape {tuple(shape)}"
        )
    blocks = data.reshape(-1, nbytes)  # [n_blocks, nbytes]
    return _DEQUANTIZERS[qtype](blocks).reshape(shape)


# --- quantization (writing blocks) ----------------------------------------------------------
# gguf-py's quantizers for these types are ports of llama.cpp's quantize_row_*_ref and
# produce identical bytes, so a synthetic model written here reads the same in llama.cpp.
_GGUF_QUANTIZED = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1})
_K_QUANTIZED = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K})
# The types `quantize()` writes. Q2_K, Q3_K and the i-quants are read but not written: gguf-py
# has no quantizer for them, and llama.cpp's need an importance matrix and a lattice search.
QUANTIZE_QTYPES: frozenset[QType] = _GGUF_QUANTIZED | _K_QUANTIZED


def quantize(values: torch.Tensor, qtype: QType) -> torch.Tensor:
    """Encode float values [*rows, cols] as GGUF blocks: uint8 [*rows, row_bytes].

    Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 match llama.cpp's reference quantizer byte for byte.
    Q4_K/Q5_K/Q6_K use a simple min/max scale choice (valid blocks, not llama.cpp's scale
    search). Other types are refused (`QUANTIZE_QTYPES`). The result is on `values`' device.
    """
    _check_supported(qtype)
    if qtype in FLOAT_QTYPES:
        raise ValueError(f"{qtype.name} is a float type; store the tensor itself, not blocks")
    if qtype not in QUANTIZE_QTYPES:
        writable = ", ".join(sorted(q.name for q in QUANTIZE_QTYPES))
        raise ValueError(f"quantize() cannot write {qtype.name} blocks (it writes {writable})")
    cols = values.shape[-1]
    row_bytes(qtype, cols)  # raises on a ragged last dimension
    if qtype in _GGUF_QUANTIZED:
        array = values.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        raw = gguf_quants.quantize(array, qtype)
        return torch.from_numpy(np.ascontiguousarray(raw)).to(values.device)
    return quant_k.quantize_k(values.float(), qtype)
