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


def _paged(
    pos: torch.Tensor, hkv: int, d: int, dtype: torch.dtype, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool [2, n_slots, Hkv, D] (its K and V) of random values, two spare blocks beside
    one table row of distinct blocks in random order per token, each row reaching 32
    positions -> (pool, block_tables [T, 32 / block_size], the pool row of each token)."""
    t, max_blocks = pos.shape[0], 32 // block_size
    gen = torch.Generator().manual_seed(seed)
    n_blocks = t * max_blocks + 2
    table = torch.randperm(n_blocks, generator=gen)[: t * max_blocks].view(t, max_blocks)
    pool = torch.randn(2, n_blocks * block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    p = pos.cpu()
    rows = table[torch.arange(t), p // block_size] * block_size + p % block_size
    return pool, table.to(DEVICE, torch.int32), rows.to(DEVICE)


@pytest.mark.parametrize(
    ("block_size", "dtype"), [(8, torch.float32), (32, torch.bfloat16)], ids=["8", "32"]
)
def test_attn_input_paged(block_size: int, dtype: torch.dtype) -> None:
    """Three tokens of three sequences, each writing through its row of the block tables into
    one pool (one at position 0, one mid-block, one at a block's last position): q, and the
    pool rows the table names, bit for bit the single-cache call's; every other row as it
    was. The reference's paged mode likewise against its single-cache mode."""
    qkv, _, norms, cos, sin, cache = _case(3, 4, 2, 16, dtype, True, seed=block_size)
    pos = torch.tensor([0, 13, 31], device=DEVICE)
    pool, table, rows = _paged(pos, 2, 16, dtype, block_size, seed=block_size)
    for fn in (attn_input, attn_input_ref):
        flat = cache.clone()
        want_q = fn(qkv, pos, norms, cos, sin, flat[0], flat[1], RopeStyle.NEOX, 1e-6)
        got = pool.clone()
        q = fn(qkv, pos, norms, cos, sin, got[0], got[1], RopeStyle.NEOX, 1e-6,
               block_tables=table, block_size=block_size)  # fmt: skip
        want = pool.clone()
        want[:, rows] = flat[:, pos]
        assert torch.equal(q, want_q), fn.__name__
        assert torch.equal(got, want), fn.__name__


def test_attn_input_past_the_reach_writes_nothing() -> None:
    """A position past what the cache holds (its S, or its table's max_blocks * block_size)
    writes no k/v (rather than past the cache or the table row); q is still returned."""
    qkv, _, norms, cos, sin, cache = _case(2, 4, 2, 16, torch.float32, True, seed=6)
    pos = torch.tensor([3, 20], device=DEVICE)
    want_q = attn_input(qkv, pos, norms, cos, sin, cache[0].clone(), cache[1].clone(),
                        RopeStyle.NEOX, 1e-6)  # fmt: skip
    short = cache[:, :16].clone()  # S = 16: position 20 is past it
    q = attn_input(qkv, pos, norms, cos, sin, short[0], short[1], RopeStyle.NEOX, 1e-6)
    assert torch.equal(q, want_q)
    unchanged = torch.ones(16, dtype=torch.bool, device=DEVICE)
    unchanged[3] = False
    assert torch.equal(short[:, unchanged], cache[:, :16][:, unchanged])
    pool, table, rows = _paged(pos, 2, 16, torch.float32, 8, seed=6)
    got = pool.clone()  # two blocks of 8 per table row: position 20 is past them
    q = attn_input(qkv, pos, norms, cos, sin, got[0], got[1], RopeStyle.NEOX, 1e-6,
                   block_tables=table[:, :2], block_size=8)  # fmt: skip
    assert torch.equal(q, want_q)
    changed = (got != pool).flatten(2).any(-1).any(0)  # [n_slots]
    assert changed.nonzero().flatten().tolist() == [int(rows[0])]


def test_attn_input_paged_checks() -> None:
    qkv, pos, norms, cos, sin, _ = _case(3, 4, 2, 16, torch.float32, True)
    pool, table, _ = _paged(pos, 2, 16, torch.float32, 8, seed=0)

    def call(**kwargs: object) -> None:
        args = {"block_tables": table, "block_size": 8, "pool": pool} | kwargs
        kv = args.pop("pool")
        attn_input(qkv, pos, norms, cos, sin, kv[0], kv[1], RopeStyle.NEOX, 1e-6, **args)  # type: ignore[index, arg-type]

    call()  # the valid call, for the ones below
    with pytest.raises(ValueError, match="int32"):
        call(block_tables=table.long())
    with pytest.raises(ValueError, match="int32 on"):
        call(block_tables=table.to("meta"))
    with pytest.raises(ValueError, match=r"must be \[3, max_blocks\]"):
        call(block_tables=table[:2])
    with pytest.raises(ValueError, match=r"must be \[3, max_blocks\]"):
        call(block_tables=table[:, :0])
    with pytest.raises(ValueError, match="contiguous rows"):
        call(block_tables=table[:, ::2])
    with pytest.raises(ValueError, match="power of two"):
        call(block_size=24)
    with pytest.raises(ValueError, match="whole blocks"):
        call(pool=pool[:, :-4].contiguous())
    with pytest.raises(ValueError, match="without block_tables"):
        call(block_tables=None)


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


@pytest.mark.gpu
def test_attn_input_paged_gpu_real_shape() -> None:
    """a3b's geometry, a decode batch of eight tokens writing into a pool of blocks."""
    qkv, _, norms, cos, sin, cache = _case(8, 32, 4, 128, torch.bfloat16, True, seed=7)
    pos = torch.tensor([0, 1, 7, 8, 13, 24, 30, 31], device=DEVICE)
    pool, table, rows = _paged(pos, 4, 128, torch.bfloat16, 8, seed=7)
    got, want = pool.clone(), pool.clone()
    q = attn_input(qkv, pos, norms, cos, sin, got[0], got[1], RopeStyle.NEOX, 1e-6,
                   block_tables=table, block_size=8)  # fmt: skip
    want_q = attn_input_ref(qkv, pos, norms, cos, sin, want[0], want[1], RopeStyle.NEOX, 1e-6,
                            block_tables=table, block_size=8)  # fmt: skip
    torch.testing.assert_close(q, want_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    others = torch.ones(got.shape[1], dtype=torch.bool, device=DEVICE)
    others[rows] = False
    assert torch.equal(got[:, others], pool[:, others])
