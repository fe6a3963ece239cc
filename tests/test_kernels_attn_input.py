"""Decode attention's input kernel (qk-norm, RoPE, cache write in one launch) against the
unfused torch composition."""

from __future__ import annotations

import pytest
import torch

from kernels.layers.attn_input import attn_input, attn_input_ref
from kernels.layers.rope import RopeStyle
from tests.kernel_cases import DEVICE


def _case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    pos = torch.randperm(32, generator=gen)[:t].to(DEVICE)
    ang = torch.arange(32, dtype=torch.float64)[:, None] / 10000 ** (
        torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
    norms = (
        (torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype),
        (torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype),
    )
    cache = torch.randn(2, 32, hkv, d, generator=gen).to(DEVICE, dtype)
    return qkv, pos, norms if norm else None, cos, sin, cache


@pytest.mark.parametrize("style", list(RopeStyle), ids=lambda s: s.value)
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 4, 2, 16), (3, 6, 3, 8)])
def test_attn_input_matches_the_unfused_ops(
    t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, style: RopeStyle
) -> None:
    qkv, pos, norms, cos, sin, cache = _case(t, hq, hkv, d, dtype, norm, seed=t + d)
    got_cache, want_cache = cache.clone(), cache.clone()
    q = attn_input(qkv, pos, norms, cos, sin, got_cache[0], got_cache[1], style, 1e-6)
    want_q = attn_input_ref(qkv, pos, norms, cos, sin, want_cache[0], want_cache[1], style, 1e-6)
    # bfloat16: the norm's 1/sqrt and torch's rsqrt may round one element apart, and the
    # rotation carries that ulp on: two ulps (2 * 2^-7 relative)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2e-2}
    assert q.shape == (t, hq, d) and q.dtype == dtype
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)  # the rows at pos, and no others
    untouched = torch.ones(32, dtype=torch.bool, device=DEVICE)
    untouched[pos] = False
    assert torch.equal(got_cache[:, untouched], cache[:, untouched])


def test_attn_input_rejects_bad_shapes() -> None:
    qkv, pos, norms, cos, sin, cache = _case(1, 4, 2, 16, torch.float32, True)
    with pytest.raises(ValueError, match="is not"):
        attn_input(qkv[:, :-3], pos, norms, cos, sin, cache[0], cache[1], RopeStyle.NEOX, 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        attn_input(qkv, pos, norms, cos[:, :4], sin[:, :4], cache[0], cache[1], RopeStyle.NEOX,
                   1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="pos"):
        attn_input(qkv, pos.float(), norms, cos, sin, cache[0], cache[1], RopeStyle.NEOX, 1e-6)


@pytest.mark.gpu
def test_attn_input_gpu_real_shape() -> None:
    """a3b's geometry: 32 q heads, 4 kv heads of 128, bfloat16."""
    qkv, pos, norms, cos, sin, cache = _case(1, 32, 4, 128, torch.bfloat16, True, seed=5)
    got_cache, want_cache = cache.clone(), cache.clone()
    q = attn_input(qkv, pos, norms, cos, sin, got_cache[0], got_cache[1], RopeStyle.NEOX, 1e-6)
    want = attn_input_ref(qkv, pos, norms, cos, sin, want_cache[0], want_cache[1],
                          RopeStyle.NEOX, 1e-6)  # fmt: skip
    torch.testing.assert_close(q, want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-2, rtol=1e-2)


def test_attn_input_caches_by_address() -> None:
    """Three tokens of three sequences, each cache a tensor of its own found by its address:
    each token's k and v land in its own cache, as the single-cache call writes them."""
    qkv, pos, norms, cos, sin, cache = _case(3, 4, 2, 16, torch.float32, True, seed=5)
    own = [cache.clone() for _ in range(3)]  # [2, S, Hkv, D] each: its K and V
    addrs = torch.tensor([[c[0].data_ptr(), c[1].data_ptr()] for c in own]).to(DEVICE)
    q = attn_input(qkv, pos, norms, cos, sin, own[0][0], own[0][1], RopeStyle.NEOX, 1e-6,
                   kv_addrs=addrs)  # fmt: skip
    for t in range(3):
        want = cache.clone()
        want_q = attn_input(qkv[t : t + 1], pos[t : t + 1], norms, cos, sin, want[0], want[1],
                            RopeStyle.NEOX, 1e-6)  # fmt: skip
        assert torch.equal(q[t : t + 1], want_q)
        assert torch.equal(own[t], want), f"token {t}'s cache"
    with pytest.raises(ValueError, match="kv_addrs"):
        attn_input(qkv, pos, norms, cos, sin, own[0][0], own[0][1], RopeStyle.NEOX, 1e-6,
                   kv_addrs=addrs[:2])  # fmt: skip
