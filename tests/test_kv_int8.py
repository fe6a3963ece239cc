"""The int8 KV cache (`kernels.formats.kv_int8`): the format's round trip, `attn_input`
writing it (bit for bit `quantize_kv` of what the float path writes), and `decode_attention`
reading it directly (against the reference over the dequantized cache, and within a derived
bound of the float cache), in the contiguous and the paged layouts."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from kernels.formats.kv_int8 import dequantize_kv, quantize_kv
from kernels.formats.kv_q4 import quantize_kv4
from kernels.layers.attention import AttentionConfig, decode_attention, decode_attention_ref
from kernels.layers.attn_input import attn_input, attn_input_ref
from kernels.layers.paged import HostPages
from kernels.layers.rope import RopeStyle
from tests.kernel_cases import DEVICE, TOL

# x / scale exactly half-way between integers (scale 1: the head's max is 127), then 0.5 less
# one ulp (floor(y + 0.5) would round it up), the largest and a negative max
TIES = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 0.49999997, -0.49999997, 3.25, -127.0]
TIES_Q = [127, 0, 2, 2, 0, -2, -2, 126, 0, 0, 3, -127]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(*shape: int, seed: int) -> torch.Tensor:
    """Normal values, each row (last dim) scaled by its own magnitude in 0.1..10: scales that
    differ row by row, so a kernel reading another row's scale is seen."""
    gen = _gen(seed)
    mag = 10 ** (torch.rand(*shape[:-1], 1, generator=gen) * 2 - 1)
    return torch.randn(*shape, generator=gen) * mag


# --- the format -------------------------------------------------------------------------------


def test_quantize_round_trip() -> None:
    """|x - q * scale| <= scale / 2 per element (plus the float32 roundings of x / scale and
    q * scale, a few 1e-6 of scale), every nonzero head reaching +-127, a zero head stored
    as scale 0 and zeros, ties rounded half to even."""
    x = _rows(5, 3, 16, seed=1)
    x[2, 1] = 0.0
    x[4, 0, :12] = torch.tensor(TIES)
    x[4, 0, 12:] = 0.0
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (5, 3)
    err = (x - dequantize_kv(q, scale)).abs()
    assert bool((err <= scale[..., None] * (0.5 + 2e-5)).all()), float(err.max())
    assert scale[2, 1] == 0 and not q[2, 1].any() and not dequantize_kv(q, scale)[2, 1].any()
    nonzero = scale > 0
    assert bool((q.abs().amax(-1)[nonzero] == 127).all()) and int(nonzero.sum()) == 14
    assert scale[4, 0] == 1.0 and q[4, 0, :12].tolist() == TIES_Q
    bf, widened = quantize_kv(x.bfloat16()), quantize_kv(x.bfloat16().float())
    assert torch.equal(bf[0], widened[0]) and torch.equal(bf[1], widened[1])  # widened exactly
    with pytest.raises(ValueError, match="int8"):
        dequantize_kv(q.float(), scale)


# --- attn_input writing int8 ------------------------------------------------------------------

HQ, HKV, D = 4, 2, 16  # GQA: two query heads per KV head


def _input_case(t: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """qkv [t, (HQ + 2 HKV) D] with token 0's first v head the TIES (float32 only: bfloat16
    cannot hold them) and token 1's last v head zero; qk-norm weights; cos/sin over 32
    positions."""
    gen = _gen(seed)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen)
    v0 = (HQ + HKV) * D
    if dtype == torch.float32:
        qkv[0, v0 : v0 + D] = torch.tensor(TIES + [0.0] * (D - len(TIES)))
    qkv[1, v0 + (HKV - 1) * D : v0 + HKV * D] = 0.0
    ang = torch.arange(32, dtype=torch.float64)[:, None] / 10000 ** (
        torch.arange(0, D, 2, dtype=torch.float64) / D
    )
    norms = ((torch.rand(D, generator=gen) + 0.5).to(DEVICE, dtype),
             (torch.rand(D, generator=gen) + 0.5).to(DEVICE, dtype))  # fmt: skip
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
    return qkv.to(DEVICE, dtype), norms, cos, sin


def _int8_cache(slots: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(k, v) int8 [slots, HKV, D] of random ints, (k, v) scales [slots, HKV] of NaN: what a
    write leaves alone is seen unchanged."""
    gen = _gen(seed)
    k, v = torch.randint(-127, 128, (2, slots, HKV, D), generator=gen, dtype=torch.int8)
    ks = torch.full((slots, HKV), float("nan"))
    return k.to(DEVICE), v.to(DEVICE), ks.to(DEVICE), ks.clone().to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.float32, 0), (torch.bfloat16, 8)], ids=["contiguous", "paged"]
)
def test_attn_input_int8_writes_quantize_kv_of_the_float_path(
    dtype: torch.dtype, block_size: int
) -> None:
    """Three tokens (contiguous: one past the cache's 24 positions, which writes nothing;
    paged: one at position 0, one mid-block, one at a block's end, through random blocks):
    q bit for bit the float path's, and the rows written bit for bit quantize_kv of the
    rotated k and the v that the float path writes (both divisions IEEE, rint half to even:
    no 1-LSB slack), scales included (the TIES head's ints as stated, the zero head scale 0);
    every other row and scale as it was. The torch reference's int8 mode likewise against
    its own float mode."""
    qkv, norms, cos, sin = _input_case(3, dtype, seed=block_size)
    paged: dict[str, object] = {}
    if block_size:
        pos = torch.tensor([0, 13, 31], device=DEVICE)
        n_blocks = 3 * 32 // block_size + 2
        table = torch.randperm(n_blocks, generator=_gen(3))[: 3 * 32 // block_size]
        table = table.view(3, -1).to(DEVICE, torch.int32)
        rows = table.long()[torch.arange(3), pos // block_size] * block_size + pos % block_size
        slots, held = n_blocks * block_size, 3
        paged = {"block_tables": table, "block_size": block_size}
    else:
        pos = torch.tensor([5, 23, 24], device=DEVICE)  # 24: past S = 24
        rows, slots, held = pos[:2], 24, 2
    # the reference writes every row it is given: only the tokens the cache holds
    for fn, n in ((attn_input, 3), (attn_input_ref, held)):
        k_f = torch.zeros(slots, HKV, D, dtype=dtype, device=DEVICE)
        v_f = torch.zeros_like(k_f)
        want_q = fn(qkv[:n], pos[:n], norms, cos, sin, k_f, v_f, RopeStyle.NEOX, 1e-6, **paged)  # type: ignore[arg-type]
        # the caches and scales: views of buffers one row longer, whose last row a write
        # past the end (or an unmasked one past the reach) would change
        buffers = _int8_cache(slots + 1, seed=7)
        before = (buffers[0].clone(), buffers[1].clone())
        k8, v8, ks, vs = (x[:slots] for x in buffers)
        q = fn(qkv[:n], pos[:n], norms, cos, sin, k8, v8, RopeStyle.NEOX, 1e-6, **paged,  # type: ignore[arg-type]
               k_scale=ks, v_scale=vs)  # fmt: skip
        assert q.dtype == dtype and torch.equal(q, want_q), fn.__name__
        (wk, wks), (wv, wvs) = quantize_kv(k_f[rows]), quantize_kv(v_f[rows])
        assert torch.equal(k8[rows], wk) and torch.equal(ks[rows], wks), fn.__name__
        assert torch.equal(v8[rows], wv) and torch.equal(vs[rows], wvs), fn.__name__
        others = torch.ones(slots + 1, dtype=torch.bool, device=DEVICE)
        others[rows] = False
        assert torch.equal(buffers[0][others], before[0][others]), fn.__name__
        assert torch.equal(buffers[1][others], before[1][others]), fn.__name__
        assert bool(buffers[2][others].isnan().all() and buffers[3][others].isnan().all())
        assert vs[rows[1], HKV - 1] == 0 and not v8[rows[1], HKV - 1].any()
        if dtype == torch.float32:
            assert v8[rows[0], 0, : len(TIES)].tolist() == TIES_Q and vs[rows[0], 0] == 1.0


def test_attn_input_int8_checks() -> None:
    qkv, norms, cos, sin = _input_case(3, torch.float32, seed=0)
    pos = torch.tensor([0, 1, 2], device=DEVICE)
    k8, v8, ks, vs = _int8_cache(8, seed=0)

    def call(**kwargs: object) -> None:
        args = {"k": k8, "v": v8, "k_scale": ks, "v_scale": vs} | kwargs
        k, v = args.pop("k"), args.pop("v")
        attn_input(qkv, pos, norms, cos, sin, k, v, RopeStyle.NEOX, 1e-6, **args)  # type: ignore[arg-type]

    call()  # the valid call, for the ones below
    with pytest.raises(ValueError, match="go together"):
        call(v_scale=None)
    with pytest.raises(ValueError, match="int8 caches take"):
        call(k_scale=None, v_scale=None)
    with pytest.raises(ValueError, match="must be int8"):
        call(k=k8.float(), v=v8.float())
    with pytest.raises(ValueError, match=r"k_scale must be contiguous float32 \[8, 2\]"):
        call(k_scale=ks[:4])
    with pytest.raises(ValueError, match="v_scale must be contiguous float32"):
        call(v_scale=vs.half())
    with pytest.raises(ValueError, match="k_scale must be contiguous"):
        call(k_scale=ks.t().contiguous().t())


# --- decode_attention reading int8 -----------------------------------------------------------


def _float_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor, lens: list[int], scale: float,
) -> torch.Tensor:  # fmt: skip
    """[B, Hq]: how far attention over the dequantized cache may be from attention over the
    float one (weights p, output o), from |k - k'| <= ks / 2 and |v - v'| <= vs / 2 alone.
    Score s moves by at most d_s = scale * |q|_1 * ks_s / 2, so p'_s = p_s e^(D_s) / Z with
    |D_s| <= d_s and Z in [Zmin, Zmax] = [sum p e^-d, sum p e^d]; then
    |o' - o| <= sum_s p'_s |v'_s - v_s| + sum_s |p'_s - p_s| |v_s - o|
             <= sum_s p_s e^d_s vs_s / 2 / Zmin
                + sum_s p_s max(e^d_s / Zmin - 1, 1 - e^-d_s / Zmax) max |v_s - o|.
    (Tight where one position holds the weight: a sequence of one position.)"""
    B, Hq, _ = q.shape
    group = Hq // k.shape[2]
    bound = torch.empty(B, Hq, dtype=torch.float64)
    for b, n in enumerate(lens):
        for h in range(Hq):
            kk, vv = k[b, :n, h // group].double(), v[b, :n, h // group].double()
            p = torch.softmax(kk @ q[b, h].double() * scale, dim=0)  # [n]
            d = scale * q[b, h].double().abs().sum() * k_scale[b, :n, h // group].double() / 2
            zmin, zmax = (p * (-d).exp()).sum(), (p * d.exp()).sum()
            moved = (p * d.exp() * v_scale[b, :n, h // group].double() / 2).sum() / zmin
            dev = torch.maximum(d.exp() / zmin - 1, 1 - (-d).exp() / zmax)
            bound[b, h] = moved + (p * dev * (vv - p @ vv).abs().amax(-1)).sum()
    return bound


def _to_pool(
    x: torch.Tensor, fill: float, lens: list[int], block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, ...] -> a pool [n_slots, ...] of blocks in random order (two spare blocks; what
    no sequence holds is `fill`) and block_tables [B, S / block_size] (entries past a
    sequence's blocks name a spare)."""
    B, S = x.shape[:2]
    used = [-(-n // block_size) for n in lens]
    n_blocks = sum(used) + 2
    ids = torch.randperm(n_blocks, generator=_gen(seed))
    table = torch.full((B, S // block_size), int(ids[-1]), dtype=torch.int32)
    pool = torch.full((n_blocks * block_size, *x.shape[2:]), fill, dtype=x.dtype)
    taken = 0
    for b, n in enumerate(lens):
        table[b, : used[b]] = ids[taken : taken + used[b]]
        taken += used[b]
        p = torch.arange(n)
        pool[table[b].long()[p // block_size] * block_size + p % block_size] = x[b, :n].cpu()
    return pool.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "split_s", "block_size"),
    [(torch.float32, 16, 0), (torch.float32, 16, 8), (torch.bfloat16, 512, 0)],
    ids=["contiguous-split", "paged-split", "contiguous-single-bf16"],
)
def test_decode_attention_int8(dtype: torch.dtype, split_s: int, block_size: int) -> None:
    """GQA (4 query heads over 2 KV heads), three sequences (40 positions, 13, 1) over int8
    caches with scales that differ row by row: against the reference over the dequantized
    cache (a float32 tolerance: the same values summed in another order; bfloat16 q: one
    rounding of the output), and within `_float_bound` of attention over the float cache.
    Split: 3 pieces of 16 positions in steps of 8, merged by the last program. Paged: the
    pool's free slots hold NaN scales (a kernel that reads one returns NaN), and the result
    is bit for bit the contiguous one (the same pieces)."""
    lens = [40, 13, 1]
    q = torch.randn(3, HQ, D, generator=_gen(11)).to(DEVICE, dtype)
    k, v = _rows(3, 40, HKV, D, seed=12).to(DEVICE), _rows(3, 40, HKV, D, seed=13).to(DEVICE)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    seq_lens = torch.tensor(lens, device=DEVICE)
    config = AttentionConfig(block_s=8, split_s=split_s)
    out = decode_attention(q, k8, v8, seq_lens, config=config, k_scale=ks, v_scale=vs)
    assert out.dtype == dtype and out.shape == q.shape
    want = decode_attention_ref(q, k8, v8, seq_lens, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, want, **TOL[dtype])
    if block_size:
        k8p, table = _to_pool(k8, 0, lens, block_size, seed=14)
        v8p, _ = _to_pool(v8, 0, lens, block_size, seed=14)
        ksp, _ = _to_pool(ks, float("nan"), lens, block_size, seed=14)
        vsp, _ = _to_pool(vs, float("nan"), lens, block_size, seed=14)
        got = decode_attention(q, k8p, v8p, seq_lens, config=config, k_scale=ksp, v_scale=vsp,
                               block_tables=table, block_size=block_size)  # fmt: skip
        assert torch.equal(got, out)
        ref = decode_attention_ref(q, k8p, v8p, seq_lens, k_scale=ksp, v_scale=vsp,
                                   block_tables=table, block_size=block_size)  # fmt: skip
        assert torch.equal(ref, want)
    if dtype == torch.float32:
        err = (out - decode_attention_ref(q, k, v, seq_lens)).abs().amax(-1).cpu().double()
        bound = _float_bound(q.cpu(), k.cpu(), v.cpu(), ks.cpu(), vs.cpu(), lens, 1 / math.sqrt(D))
        assert bool((err <= bound + 1e-5).all()), (err, bound)  # 1e-5: float32 roundings


def _pooled(
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], d: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Three sequences of 40, 13 and 1 positions stored by `quantize`, in a pool of blocks of
    8 in random order: q, [k codes, v codes, k scales, v scales] (NaN scales where no
    sequence is), the block tables and the lengths."""
    lens = [40, 13, 1]
    q = torch.randn(3, HQ, d, generator=_gen(seed)).to(DEVICE)
    k = _rows(3, 40, HKV, d, seed=seed + 1).to(DEVICE)
    v = _rows(3, 40, HKV, d, seed=seed + 2).to(DEVICE)
    (kc, ks), (vc, vs) = quantize(k), quantize(v)
    _, table = _to_pool(kc, 0, lens, 8, seed=seed + 3)
    pools = [_to_pool(t, fill, lens, 8, seed=seed + 3)[0]
             for t, fill in ((kc, 0), (vc, 0), (ks, float("nan")), (vs, float("nan")))]  # fmt: skip
    return q, pools, table, torch.tensor(lens, device=DEVICE)


def _host_split(pools: list[torch.Tensor], first: int) -> tuple[list[torch.Tensor], HostPages]:
    """The pools' blocks from `first` on as a host tier; the first tier's rows there garbage
    codes and NaN scales."""
    cut, dev = first * 8, [t.clone() for t in pools]
    for t in dev:
        t[cut:] = float("nan") if t.is_floating_point() else 77
    k, v, ks, vs = (t[cut:].clone() for t in pools)
    return dev, HostPages(k, v, ks, vs, first)


def test_decode_attention_int8_reads_the_host_tier() -> None:
    """An int8 pool's blocks from 3 on, ints and scales, in a second tier: bit for bit the
    one-tier call, and the reference agrees."""
    q, pools, table, seq_lens = _pooled(quantize_kv, D, seed=21)
    config = AttentionConfig(block_s=8, split_s=16)
    paged = {"block_tables": table, "block_size": 8}
    kp, vp, ksp, vsp = pools
    want = decode_attention(q, kp, vp, seq_lens, config=config, k_scale=ksp, v_scale=vsp,
                            **paged)  # type: ignore[arg-type]
    (kd, vd, ksd, vsd), host = _host_split(pools, 3)
    got = decode_attention(q, kd, vd, seq_lens, config=config, k_scale=ksd, v_scale=vsd,
                           host=host, **paged)  # type: ignore[arg-type]
    assert torch.equal(got, want)
    ref = decode_attention_ref(q, kd, vd, seq_lens, k_scale=ksd, v_scale=vsd, host=host,
                               **paged)  # type: ignore[arg-type]
    torch.testing.assert_close(ref, want, **TOL[torch.float32])
    with pytest.raises(ValueError, match="scales"):
        decode_attention(q, kd, vd, seq_lens, k_scale=ksd, v_scale=vsd,
                         host=HostPages(host.k, host.v, None, None, 3), **paged)  # type: ignore[arg-type]


def test_decode_attention_int8_checks() -> None:
    q = torch.randn(2, HQ, D, device=DEVICE)
    (k8, ks), (v8, vs) = (quantize_kv(torch.randn(2, 8, HKV, D, device=DEVICE)) for _ in "kv")
    lens = torch.tensor([8, 3], device=DEVICE)

    def call(**kwargs: object) -> None:
        args = {"k": k8, "v": v8, "k_scale": ks, "v_scale": vs} | kwargs
        k, v = args.pop("k"), args.pop("v")
        decode_attention(q, k, v, lens, **args)  # type: ignore[arg-type]

    call()  # the valid call, for the ones below
    with pytest.raises(ValueError, match="go together"):
        call(k_scale=None)
    with pytest.raises(TypeError, match="int8 caches take"):
        call(k_scale=None, v_scale=None)
    with pytest.raises(TypeError, match="float q and int8 caches"):
        call(k=k8.float(), v=v8.float())
    with pytest.raises(ValueError, match=r"v_scale must be float32 \[2, 8, 2\]"):
        call(v_scale=vs[:, :4])
    with pytest.raises(ValueError, match="k_scale must be float32"):
        call(k_scale=ks.half())


def test_decode_attention_q4_reads_the_codes_directly() -> None:
    """A 4-bit pool (codes two a byte, a float16 scale and minimum per 32 values), paged in
    random order: against the reference over the dequantized rows (float32: the same values
    summed in another order), pieces merged; with part of it in a host tier, bit for bit
    the same."""
    q, pools, table, seq_lens = _pooled(quantize_kv4, 64, seed=31)
    config = AttentionConfig(block_s=8, split_s=16)
    paged = {"block_tables": table, "block_size": 8}
    kp, vp, kdp, vdp = pools
    got = decode_attention(q, kp, vp, seq_lens, config=config, k_scale=kdp, v_scale=vdp,
                           **paged)  # type: ignore[arg-type]
    want = decode_attention_ref(q, kp, vp, seq_lens, k_scale=kdp, v_scale=vdp,
                                **paged)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    (kd, vd, ksd, vsd), host = _host_split(pools, 3)
    split = decode_attention(q, kd, vd, seq_lens, config=config, k_scale=ksd, v_scale=vsd,
                             host=host, **paged)  # type: ignore[arg-type]
    assert torch.equal(split, got)
    with pytest.raises(ValueError, match="paged pools"):
        decode_attention(q[:1], kp[:40][None], vp[:40][None], seq_lens[:1],
                         k_scale=kdp[:40][None], v_scale=vdp[:40][None])  # fmt: skip
    with pytest.raises(ValueError, match="float16"):
        decode_attention(q, kp, vp, seq_lens, k_scale=kdp.float(), v_scale=vdp, **paged)  # type: ignore[arg-type]
