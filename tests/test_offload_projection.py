"""Dense projections held as GGUF blocks (`stratad/engine/offload/projection.py`): the rows
stacked by type, the gated attention's rows split as the dequantized matrix is, and prefill's
GEMMs over slices dequantized as they go."""

from __future__ import annotations

import pytest
import torch

from kernels.formats.quant import QTensor, QType, quantize
from kernels.tuning.configs import INTERPRETED
from stratad.engine.offload import projection
from stratad.engine.offload.dense import _split_gates
from stratad.engine.offload.projection import gguf_matrix, gguf_rows, split_gate_rows


def _tensor(qtype: QType, n: int, k: int, seed: int) -> QTensor:
    values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return QTensor(quantize(values, qtype).reshape(n, -1), qtype, (n, k))


def test_rows_stack_by_type_and_prefill_dequantizes_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q and k (Q4_K) share a run, v (Q8_0) is its own: int8 dots per run, and the GEMMs over
    slices of 3 rows (a scratch that small) give x @ the dequantized stack^T."""
    q, k, v = _tensor(QType.Q4_K, 8, 256, 0), _tensor(QType.Q4_K, 4, 256, 1), _tensor(
        QType.Q8_0, 4, 256, 2)  # fmt: skip
    m = gguf_matrix([gguf_rows(t) for t in (q, k, v)], torch.device("cpu"))
    assert m is not None and (m.rows, m.cols) == (16, 256)
    assert [(b.shape[0], t) for b, t in m.parts] == [(12, QType.Q4_K), (4, QType.Q8_0)]
    assert m.nbytes == sum(t.data.numel() for t in (q, k, v))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    want = x @ torch.cat([t.dequantize() for t in (q, k, v)]).t()
    monkeypatch.setattr(projection, "SCRATCH_BYTES", 3 * 256 * 4)
    assert torch.allclose(m.dequantized(x), want, atol=1e-4)
    got = m(x, INTERPRETED.qlinear)  # x rounded to its Q8 rows
    assert (got - want).norm() / want.norm() < 3e-2


def test_unreadable_types_and_mixed_widths() -> None:
    f16 = QTensor(torch.zeros(4, 256, dtype=torch.float16), QType.F16, (4, 256))
    q8 = _tensor(QType.Q8_0, 4, 256, 0)
    assert gguf_rows(f16) is None
    assert gguf_matrix([gguf_rows(q8), gguf_rows(f16)], torch.device("cpu")) is None
    with pytest.raises(ValueError, match="different numbers of values"):
        gguf_matrix([gguf_rows(q8), gguf_rows(_tensor(QType.Q8_0, 4, 512, 1))],
                    torch.device("cpu"))  # fmt: skip


def test_gate_rows_split_as_the_dequantized_matrix() -> None:
    """Qwen3-Next's q projection (per head its query rows, then its gate's): the blocks' rows
    split as `_split_gates` splits the values."""
    q = _tensor(QType.Q8_0, 3 * 2 * 4, 64, 0)
    group = gguf_rows(q)
    assert group is not None
    (queries, _), (gates, _) = split_gate_rows(group, 3)
    want_q, want_g = _split_gates(q.dequantize(), 3)
    for rows, want in ((queries, want_q), (gates, want_g)):
        got = QTensor(rows.contiguous(), QType.Q8_0, (rows.shape[0], 64)).dequantize()
        assert torch.equal(got, want)
