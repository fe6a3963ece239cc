"""The low-bit i-quants on the CPU kernels: the C side's view of the tables and type codes
matches the Python side's, and the row dots' one-activation build matches their tiled one.
(Each type against its torch reference: tests/test_cpu_experts.py.)

The CPU kernels (kernels/cpu/decode.h, decode_iq_low.h) index the one tables buffer of
`kernels.formats.iq_tables` at offsets written as #defines, and name GGUF types by their codes: both
are read back from the headers here, so a table appended or moved on one side only fails here
by name (the per-type products in test_cpu_experts.py fail too, less legibly).
"""

from __future__ import annotations

import re

import pytest
import torch

from kernels.cpu.build import SOURCE_DIR
from kernels.cpu.experts import CPU_EXPERT_QTYPES, CpuExperts
from kernels.formats import iq_tables
from kernels.formats.quant import QType
from stratad.tuning.bench_weights import random_blocks

HEADERS = ("decode.h", "decode_iq_low.h")


def _headers() -> str:
    return "\n".join((SOURCE_DIR / name).read_text() for name in HEADERS)


def test_table_offsets_match_iq_tables() -> None:
    defines = dict(re.findall(r"^#define (\w+) (\d+)$", _headers(), re.M))
    offsets = {name: int(v) for name, v in defines.items() if hasattr(iq_tables, name)}
    assert set(offsets) >= {"IQ3_S_GRID", "IQ4_VALUES", "IQ3_XXS_GRID", "IQ2_XXS_GRID",
                            "IQ2_XS_GRID", "IQ2_S_GRID", "IQ1_S_GRID", "KSIGNS",
                            "MXFP4_VALUES"}  # fmt: skip
    assert offsets == {name: getattr(iq_tables, name) for name in offsets}


def test_type_codes_are_gguf_s() -> None:
    codes = {name: int(v) for name, v in re.findall(r"\bT_(\w+) = (\d+)", _headers())}
    assert codes == {name: int(QType[name]) for name in codes}
    assert {q.name for q in CPU_EXPERT_QTYPES} <= set(codes)


LOW_BIT = [QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S]


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda t: t.name)
def test_one_token_is_a_row_of_many(qtype: QType) -> None:
    """The row dots compile one activation apart from a tile of them (fused_iq_low_avx2.h):
    the same sums in the same order, so the same bits."""
    rows, cols = 8, 512
    w = random_blocks(qtype, rows, cols, torch.device("cpu"))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    cpu = CpuExperts(1)
    many = cpu.matmul(x, w, qtype, rows, cols)
    assert torch.equal(cpu.matmul(x[1:2].contiguous(), w, qtype, rows, cols), many[1:2])
    assert many.abs().sum() > 0
