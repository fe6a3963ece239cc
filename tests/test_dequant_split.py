"""Split-Q4_0 dequantization (kernels/formats/dequant.py): the Triton kernel bit for bit against its
torch reference and against the GGUF dequantization of the same blocks (kernels/formats/quant.py),
for every output dtype, on contiguous and strided inputs, aligned or not.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.experts.moe import split_q4_0
from kernels.formats.dequant import (
    DEQUANT_DTYPES,
    dequant_q4_0_split,
    dequant_q4_0_split_ref,
    nibble_words,
)
from kernels.formats.quant import QTensor, QType

DTYPES = pytest.mark.parametrize("dtype", DEQUANT_DTYPES, ids=str)
# Large scales overflow float16 on purpose (to inf, as in torch); numpy warns in the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def _scales(count: int, gen: torch.Generator) -> torch.Tensor:
    """Finite fp16 scales of either sign over many magnitudes (fp16 subnormals to overflowing
    products), as bytes [count * 2]."""
    mag = 2.0 ** torch.randint(-26, 14, (count,), generator=gen).float()
    d = (torch.randn(count, generator=gen) * mag).clamp(-65504, 65504).half()
    d[:2] = torch.tensor([0.0, -0.0])[: min(2, count)]
    return d.view(torch.uint8)


def _blocks(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """GGUF Q4_0 blocks [rows, cols/32 * 18]: random scales, random nibble bytes."""
    nb = cols // 32
    scales = _scales(rows * nb, gen).view(rows, nb, 2)
    nibbles = torch.randint(0, 256, (rows, nb, 16), dtype=torch.uint8, generator=gen)
    return torch.cat([scales, nibbles], dim=-1).reshape(rows, nb * 18)


def _case(n: int, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(split sections [n, bytes], GGUF dequantization float32 [n, rows, cols])."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [_blocks(rows, cols, gen) for _ in range(n)]
    sections = torch.stack([split_q4_0(b) for b in blocks])
    want = torch.stack([QTensor(b, QType.Q4_0, (rows, cols)).dequantize() for b in blocks])
    return sections, want


@DTYPES
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (5, 96), (32, 32), (32, 96)])
def test_matches_reference_and_gguf(n: int, rows: int, cols: int, dtype: torch.dtype) -> None:
    sections, want = _case(n, rows, cols, seed=rows * cols + n)
    ref = dequant_q4_0_split_ref(sections, rows, cols)
    assert ref.dtype == torch.float32 and torch.equal(ref, want)
    got = dequant_q4_0_split(sections, rows, cols, dtype)
    assert got.shape == (n, rows, cols) and got.dtype == dtype
    assert torch.equal(got, ref.to(dtype))
    assert torch.equal(got, want.to(dtype))


def test_both_load_widths_are_covered() -> None:
    """The shapes above take both paths: nibbles as words (32 rows: 64 or 192 bytes of
    scales) and byte by byte (1 or 5 rows)."""
    assert nibble_words(_case(3, 32, 96)[0], 32, 96)
    assert not nibble_words(_case(3, 5, 96)[0], 5, 96)
    assert not nibble_words(_case(1, 1, 32)[0], 1, 32)


@DTYPES
@pytest.mark.parametrize(("offset", "words"), [(0, True), (8, True), (1, False), (2, False)])
def test_column_slice_of_a_wider_buffer(offset: int, words: bool, dtype: torch.dtype) -> None:
    """Like the prefill staging buffer: one matrix of every blob, a column slice."""
    rows, cols = 32, 96
    sections, want = _case(3, rows, cols, seed=offset)
    wide = torch.randint(0, 256, (3, sections.shape[1] + 24), dtype=torch.uint8)
    view = wide[:, offset : offset + sections.shape[1]]
    view.copy_(sections)
    assert view.stride() == (wide.shape[1], 1) and nibble_words(view, rows, cols) == words
    got = dequant_q4_0_split(view, rows, cols, dtype)
    assert torch.equal(got, want.to(dtype))


def test_odd_stride_between_matrices() -> None:
    rows, cols = 32, 64
    sections, want = _case(3, rows, cols, seed=7)
    wide = torch.zeros((3, sections.shape[1] + 3), dtype=torch.uint8)
    view = wide[:, : sections.shape[1]]
    view.copy_(sections)
    assert not nibble_words(view, rows, cols)
    assert torch.equal(dequant_q4_0_split(view, rows, cols, torch.float32), want)


@DTYPES
def test_out_buffer_is_reused(dtype: torch.dtype) -> None:
    rows, cols = 32, 96
    out = torch.full((3, rows, cols), 7.0, dtype=dtype)
    for seed in (1, 2):
        sections, want = _case(3, rows, cols, seed=seed)
        got = dequant_q4_0_split(sections, rows, cols, dtype, out=out)
        assert got is out and torch.equal(out, want.to(dtype))


def test_no_matrices() -> None:
    got = dequant_q4_0_split(torch.empty((0, 18), dtype=torch.uint8), 1, 32, torch.bfloat16)
    assert got.shape == (0, 1, 32)


def test_bad_inputs() -> None:
    rows, cols = 4, 64
    sections, _ = _case(2, rows, cols)
    bf16 = torch.bfloat16
    with pytest.raises(ValueError, match="uint8"):
        dequant_q4_0_split(sections.to(torch.int16), rows, cols, bf16)
    with pytest.raises(ValueError, match="2-D"):
        dequant_q4_0_split(sections[0], rows, cols, bf16)
    with pytest.raises(ValueError, match="multiple of 32"):
        dequant_q4_0_split(sections, rows, 48, bf16)
    with pytest.raises(ValueError, match="takes 72 bytes"):
        dequant_q4_0_split(sections, 2, cols, bf16)
    strided = torch.stack([sections, sections], dim=-1).reshape(2, -1)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        dequant_q4_0_split(strided, rows, cols, bf16)
    with pytest.raises(ValueError, match="dtype"):
        dequant_q4_0_split(sections, rows, cols, torch.float64)
    with pytest.raises(ValueError, match="out must be"):
        dequant_q4_0_split(sections, rows, cols, bf16, out=torch.empty(2, rows, cols))
    with pytest.raises(ValueError, match="out must be"):
        dequant_q4_0_split(sections, rows, cols, bf16, out=torch.empty(2, cols, rows, dtype=bf16))
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.empty(2, cols, rows, dtype=bf16).transpose(1, 2)
        dequant_q4_0_split(sections, rows, cols, bf16, out=t)


# --- real shapes on a GPU ---------------------------------------------------------------------


@pytest.mark.gpu
def test_dequant_real_shapes_gpu() -> None:
    """a3b experts: 128 blobs [gate [768, 2048] | up | down [2048, 768]] in one staging-like
    buffer; each matrix a column slice. Correctness only; the bandwidth is printed."""
    e, f, h = 128, 768, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_bytes = f * h // 32 * 18
    buf = torch.randint(
        0, 256, (e, 3 * gate_bytes), dtype=torch.uint8, device="cuda", generator=gen
    )
    for lo, rows, cols in ((0, f, h), (2 * gate_bytes, h, f)):
        count = rows * cols // 32
        d = (torch.randn(e, count, device="cuda", generator=gen) * 1e-2).half()
        buf[:, lo : lo + 2 * count] = d.view(torch.uint8)
        sections = buf[:, lo : lo + gate_bytes]
        assert nibble_words(sections, rows, cols)
        out = dequant_q4_0_split(sections, rows, cols, torch.bfloat16)
        assert torch.equal(out, dequant_q4_0_split_ref(sections, rows, cols).to(torch.bfloat16))
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            dequant_q4_0_split(sections, rows, cols, torch.bfloat16, out=out)
        stop.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(stop) / 1e3 / reps
        written, read = out.numel() * out.element_size(), sections.numel()
        print(
            f"dequant [{e}, {rows}, {cols}] bf16: {seconds * 1e6:.0f} us,"
            f" {written / seconds / 1e9:.0f} GB/s written,"
            f" {(written + read) / seconds / 1e9:.0f} GB/s read + written"
        )
