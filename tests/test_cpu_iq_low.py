"""The C kernels' view of the i-quant tables and type codes matches the Python side's.

The CPU kernels (kernels/cpu/decode.h, decode_iq_low.h) index the one tables buffer of
`kernels.iq_tables` at offsets written as #defines, and name GGUF types by their codes: both
are read back from the headers here, so a table appended or moved on one side only fails here
by name (the per-type products in test_cpu_experts.py fail too, less legibly).
"""

from __future__ import annotations

import re

from kernels import iq_tables
from kernels.cpu_build import SOURCE_DIR
from kernels.cpu_experts import CPU_EXPERT_QTYPES
from kernels.quant import QType

HEADERS = ("decode.h", "decode_iq_low.h")


def _headers() -> str:
    return "\n".join((SOURCE_DIR / name).read_text() for name in HEADERS)


def test_table_offsets_match_iq_tables() -> None:
    defines = dict(re.findall(r"^#define (\w+) (\d+)$", _headers(), re.M))
    offsets = {name: int(v) for name, v in defines.items() if hasattr(iq_tables, name)}
    assert set(offsets) >= {"IQ3_S_GRID", "IQ4_VALUES", "IQ3_XXS_GRID", "IQ2_XXS_GRID",
                            "IQ2_XS_GRID", "IQ2_S_GRID", "IQ1_S_GRID", "KSIGNS"}  # fmt: skip
    assert offsets == {name: getattr(iq_tables, name) for name in offsets}


def test_type_codes_are_gguf_s() -> None:
    codes = {name: int(v) for name, v in re.findall(r"\bT_(\w+) = (\d+)", _headers())}
    assert codes == {name: int(QType[name]) for name in codes}
    assert {q.name for q in CPU_EXPERT_QTYPES} <= set(codes)
