"""The routing kernel (softmax, top-k, renormalisation in one launch) against torch."""

from __future__ import annotations

import pytest
import torch

from kernels.experts.router import route_topk, route_topk_ref
from stratad.engine.reference.layers import route


@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (3, 60, 4), (5, 128, 8), (2, 64, 6)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_route_topk_matches_reference(
    t: int, e: int, k: int, normalize: bool, dtype: torch.dtype
) -> None:
    logits = (torch.randn(t, e, generator=torch.Generator().manual_seed(e)) * 3).to(dtype)
    weights, ids = route_topk(logits, k, normalize)
    want_w, want_ids = route_topk_ref(logits, k, normalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    engine_w, engine_ids = route(logits, k, normalize)  # the reference engine's routing
    assert torch.equal(ids.long(), engine_ids)
    torch.testing.assert_close(weights, engine_w, rtol=1e-6, atol=1e-7)


def test_route_topk_ties_go_to_the_lower_index() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    _, ids = route_topk(logits, 3, normalize=True)
    assert ids.tolist() == [[1, 2, 4]]


def test_route_topk_on_a_strided_row_view_and_bad_input() -> None:
    wide = torch.randn(4, 40)
    logits = wide[:, :32]  # rows 40 apart
    weights, ids = route_topk(logits, 4, normalize=False)
    assert torch.equal(ids, route_topk_ref(logits, 4, False)[1])
    with pytest.raises(ValueError, match="top_k 33"):
        route_topk(logits, 33, normalize=True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        route_topk(torch.randn(3), 1, normalize=True)


@pytest.mark.gpu
def test_route_topk_gpu_real_shape() -> None:
    logits = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(logits, 8, normalize=True)
    want_w, want_ids = route_topk_ref(logits, 8, True)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    # bf16 logits repeat within a row; equal ones may be taken in either order
    probs = logits.float().softmax(-1)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, want_ids.long()))
