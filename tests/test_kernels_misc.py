"""The small Triton kernels (RoPE, SiLU-gate, decode attention; RMSNorm has
tests/test_kernels_norm.py) against their torch references on ragged shapes; the references
against textbook formulas where they are not one already.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported); triton itself is a hard dependency, so a
missing triton fails here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import triton  # noqa: F401  (imported for the failure when it is missing)

from kernels.layers import attention
from kernels.layers.activation import (
    ActivationConfig,
    silu_mul,
    silu_mul_packed,
    silu_mul_ref,
)
from kernels.layers.attention import (
    AttentionConfig,
    attention_counts,
    decode_attention,
    decode_attention_ref,
)
from kernels.layers.paged import HostPages
from kernels.layers.rope import (
    RopeConfig,
    RopeStyle,
    apply_rope,
    rope,
    rope_inv_freq,
    rope_ref,
    rope_table,
)
from tests.kernel_cases import DEVICE, FLOATS, TOL, randn
from tests.sm90_compile import compile_case

# --- RoPE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("style", list(RopeStyle), ids=lambda s: s.value)
@pytest.mark.parametrize(
    ("tokens", "heads", "dim", "rotary"),
    [(1, 1, 8, 8), (3, 5, 16, 16), (4, 3, 24, 16), (2, 7, 12, 12)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope(
    style: RopeStyle, tokens: int, heads: int, dim: int, rotary: int, dtype: torch.dtype
) -> None:
    x = randn(tokens, heads, dim, dtype=dtype, seed=heads)
    positions = torch.tensor([0, 7, 1000, 32767][:tokens] + [5] * max(0, tokens - 4), device=DEVICE)
    inv_freq = rope_inv_freq(rotary, 10000.0, DEVICE)
    out = rope(x, positions, inv_freq, style, RopeConfig(block_h=2))
    assert out.shape == x.shape and out.dtype == dtype
    # Angles up to 32767 rad: float32 sin/cos of large arguments differ by ~1e-6 between
    # libraries; the rotation keeps the magnitude so the absolute tolerance is enough.
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, rope_ref(x, positions, inv_freq, style), **tol)
    assert torch.equal(out[..., rotary:], x[..., rotary:])


@pytest.mark.parametrize("style", list(RopeStyle))
def test_rope_from_tables_matches_engine_reference(style: RopeStyle) -> None:
    """cos/sin tables by position (float64 angles) give the engine's torch rotation."""
    from stratad.engine.reference.layers import apply_rope as engine_rope

    x = randn(3, 4, 16, dtype=torch.float32, seed=4)
    positions = torch.tensor([0, 9, 40000], device=DEVICE)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    ang = torch.arange(40001, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
    out = rope_table(x, positions, cos, sin, style, RopeConfig(block_h=2))
    want = engine_rope(x, cos[positions], sin[positions], style == RopeStyle.INTERLEAVED)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        rope_table(x, positions, cos.double(), sin.double(), style)


def test_rope_reference_by_complex_rotation() -> None:
    """Interleaved pairs are complex numbers multiplied by e^{i pos freq} (Meta's Llama);
    NEOX is the same after moving the halves into pairs."""
    x = randn(3, 2, 8, seed=4)
    positions = torch.tensor([0, 3, 11], device=DEVICE)
    inv_freq = rope_inv_freq(8, 500000.0, DEVICE)
    rotation = torch.polar(torch.ones(3, 4, device=DEVICE), positions[:, None] * inv_freq)
    pairs = torch.view_as_complex(x.reshape(3, 2, 4, 2).contiguous())
    expected = torch.view_as_real(pairs * rotation[:, None, :]).flatten(-2)
    torch.testing.assert_close(rope_ref(x, positions, inv_freq, RopeStyle.INTERLEAVED), expected)
    to_pairs = torch.stack([x[..., :4], x[..., 4:]], dim=-1).flatten(-2)
    neox = rope_ref(x, positions, inv_freq, RopeStyle.NEOX)
    torch.testing.assert_close(
        torch.stack([neox[..., :4], neox[..., 4:]], -1).flatten(-2),
        rope_ref(to_pairs, positions, inv_freq, "interleaved"),
    )


def test_apply_rope_on_strided_views() -> None:
    qkv = randn(3, 4 + 2 + 2, 16, seed=5)  # one fused projection, heads split by views
    q, k = qkv[:, :4], qkv[:, 4:6]
    positions = torch.tensor([2, 9, 40], device=DEVICE)
    inv_freq = rope_inv_freq(16, 10000.0, DEVICE)
    q_out, k_out = apply_rope(q, k, positions, inv_freq, RopeStyle.NEOX)
    torch.testing.assert_close(q_out, rope_ref(q, positions, inv_freq, RopeStyle.NEOX))
    torch.testing.assert_close(k_out, rope_ref(k, positions, inv_freq, RopeStyle.NEOX))


# --- SiLU gate ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 1), (3, 100), (2, 300)])
def test_silu_mul(tokens: int, inter: int, dtype: torch.dtype) -> None:
    gate = randn(tokens, inter, dtype=dtype, seed=6) * 4
    up = randn(tokens, inter, dtype=dtype, seed=7)
    out = silu_mul(gate, up, ActivationConfig(block=128))
    assert out.dtype == dtype
    torch.testing.assert_close(out, silu_mul_ref(gate, up), **TOL[dtype])


def test_silu_mul_packed_and_reference() -> None:
    gate_up = randn(2, 3, 2 * 48, seed=8) * 4
    gate, up = gate_up[..., :48], gate_up[..., 48:]
    textbook = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_mul_ref(gate, up), textbook)
    torch.testing.assert_close(silu_mul_packed(gate_up), textbook)
    with pytest.raises(ValueError, match="differ"):
        silu_mul(gate, up[..., :47])


# --- decode attention -----------------------------------------------------------------------


def attention_inputs(
    batch: int, hq: int, hkv: int, dim: int, s_max: int, dtype: torch.dtype, seed: int
):
    q = randn(batch, hq, dim, dtype=dtype, seed=seed)
    k = randn(batch, s_max, hkv, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, s_max, hkv, dim, dtype=dtype, seed=seed + 2)
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, s_max + 1, (batch,), generator=gen)
    lens[0] = s_max  # one full sequence
    return q, k, v, lens.to(DEVICE)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize(("batch", "dim", "s_max"), [(1, 16, 1), (3, 16, 37), (2, 24, 5)])
def test_decode_attention(batch: int, hq: int, hkv: int, dim: int, s_max: int) -> None:
    q, k, v, lens = attention_inputs(batch, hq, hkv, dim, s_max, torch.float32, seed=s_max)
    out = decode_attention(q, k, v, lens, config=AttentionConfig(block_s=16))
    assert out.shape == q.shape
    torch.testing.assert_close(out, decode_attention_ref(q, k, v, lens), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_attention_half_and_scale(dtype: torch.dtype) -> None:
    q, k, v, lens = attention_inputs(2, 4, 2, 32, 20, dtype, seed=9)
    out = decode_attention(q, k, v, lens, scale=0.3, config=AttentionConfig(block_s=8))
    assert out.dtype == dtype
    torch.testing.assert_close(out, decode_attention_ref(q, k, v, lens, scale=0.3), **TOL[dtype])


def test_decode_attention_reference_per_head() -> None:
    """The reference against a loop over sequences and heads with plain softmax."""
    q, k, v, lens = attention_inputs(2, 4, 2, 8, 6, torch.float32, seed=10)
    ref = decode_attention_ref(q, k, v, lens)
    for b in range(2):
        n = int(lens[b])
        for h in range(4):
            kv = h // 2
            weights = torch.softmax(k[b, :n, kv] @ q[b, h] / math.sqrt(8), dim=0)
            torch.testing.assert_close(ref[b, h], weights @ v[b, :n, kv])


def test_decode_attention_on_strided_caches() -> None:
    """Caches that are views (slots of a larger pool, or a [B, Hkv, S, D] layout
    transposed) are read in place."""
    pool_k = randn(5, 12, 2, 16, seed=11)
    pool_v = randn(5, 12, 2, 16, seed=12)
    k, v = pool_k[::2][:2], pool_v[::2][:2]  # slots 0 and 2 of the pool
    q = randn(2, 4, 16, seed=13)
    lens = torch.tensor([12, 7], device=DEVICE)
    expected = decode_attention_ref(q, k.contiguous(), v.contiguous(), lens)
    torch.testing.assert_close(decode_attention(q, k, v, lens), expected)
    head_major_k = k.transpose(1, 2).contiguous().transpose(1, 2)  # strides of [B, Hkv, S, D]
    head_major_v = v.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(decode_attention(q, head_major_k, head_major_v, lens), expected)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(randn(2, 3, 16), k, v, lens)


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (8, 2)])  # GQA groups 1 and 4
@pytest.mark.parametrize(
    ("s_max", "lens"),
    [
        # 5 pieces of 16, the last one 6 long: mid-piece, on a boundary, 1, S.
        (70, [37, 32, 1, 70, 16, 17]),
        (64, [64, 48, 1, 15]),  # S a whole number of pieces
        # 38 pieces: the last program merges them 8 at a time (five blocks, the last partial)
        (300, [300, 256, 129, 2]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_attention_split(
    hq: int, hkv: int, s_max: int, lens: list[int], dtype: torch.dtype
) -> None:
    """Split-K: pieces of split_s positions, merged by the last program, against the
    reference and against the single pass (split_s >= S); and with the piece count capped
    (max_splits), so that each piece holds a share of the current length."""
    q, k, v, _ = attention_inputs(len(lens), hq, hkv, 16, s_max, dtype, seed=len(lens))
    seq_lens = torch.tensor(lens, device=DEVICE)
    expected = decode_attention_ref(q, k, v, seq_lens)
    split_s = 8 if s_max > 128 else 16
    config = AttentionConfig(block_s=8, split_s=split_s)
    out = decode_attention(q, k, v, seq_lens, config=config)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, **TOL[dtype])
    single = decode_attention(q, k, v, seq_lens, config=AttentionConfig(block_s=8, split_s=512))
    torch.testing.assert_close(single, expected, **TOL[dtype])
    for cap in (2, 3):
        capped = AttentionConfig(block_s=8, split_s=split_s, max_splits=cap)
        out = decode_attention(q, k, v, seq_lens, config=capped)
        torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize(("window", "sinks"), [(0, True), (9, False), (24, True)],
                         ids=["sinks", "window", "window-sinks"])  # fmt: skip
@pytest.mark.parametrize("split_s", [8, 512], ids=["split", "single"])
def test_decode_attention_sinks_and_window(window: int, sinks: bool, split_s: int) -> None:
    """gpt-oss's attention: a sink logit per query head in each softmax, a sliding window
    (lengths inside it, across it, and past it by many pieces): against the reference, and
    the reference against the model's own attention for the last position."""
    from stratad.engine.reference.layers import attention as model_attention

    lens = [70, 5, 24, 33]
    q, k, v, _ = attention_inputs(len(lens), 8, 2, 16, 70, torch.float32, seed=window + 3)
    seq_lens = torch.tensor(lens, device=DEVICE)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(DEVICE) if sinks else None
    expected = decode_attention_ref(q, k, v, seq_lens, sinks=sink, window=window)
    config = AttentionConfig(block_s=8, split_s=split_s, max_splits=64)
    out = decode_attention(q, k, v, seq_lens, config=config, sinks=sink, window=window)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    for b, n in enumerate(lens):
        alone = model_attention(q[b][None].cpu(), k[b, :n].cpu(), v[b, :n].cpu(), n - 1,
                                None if sink is None else sink.cpu(), window)  # fmt: skip
        torch.testing.assert_close(expected[b].cpu(), alone[0], **TOL[torch.float32])
    plain = decode_attention_ref(q, k, v, seq_lens)
    assert (plain - expected).abs().max() > 1e-2  # the sinks and the window count


def test_decode_attention_sinks_and_window_compile_for_sm90() -> None:
    """The branches sinks and a window add compile for an sm90 GPU (the interpreter runs
    what the compiler refuses: a global read in the kernel that was no constexpr did so)."""
    out = compile_case("attention")
    assert out.count("_decode_attention_kernel: ") == 2, out


def test_decode_attention_sinks_checked() -> None:
    q, k, v, _ = attention_inputs(1, 4, 2, 16, 8, torch.float32, seed=2)
    lens = torch.tensor([8], device=DEVICE)
    with pytest.raises(ValueError, match="sinks must be"):
        decode_attention(q, k, v, lens, sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="negative"):
        decode_attention(q, k, v, lens, window=-1)


@pytest.mark.parametrize("split_s", [16, 128], ids=["split", "single"])
def test_decode_attention_seq_lens_changed_in_place(split_s: int) -> None:
    """As in a CUDA graph replay: the same tensors, seq_lens changed in place between the
    calls, give each call's answer."""
    q, k, v, _ = attention_inputs(3, 4, 1, 16, 70, torch.float32, seed=14)
    seq_lens = torch.tensor([5, 70, 33], device=DEVICE)
    config = AttentionConfig(block_s=8, split_s=split_s)
    first = decode_attention(q, k, v, seq_lens, config=config)
    seq_lens.copy_(torch.tensor([70, 1, 48], device=DEVICE))
    second = decode_attention(q, k, v, seq_lens, config=config)
    for out, lens in ((first, [5, 70, 33]), (second, [70, 1, 48])):
        expected = decode_attention_ref(q, k, v, torch.tensor(lens, device=DEVICE))
        torch.testing.assert_close(out, expected, **TOL[torch.float32])



@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The grids decode attention launches, its kernel recorded rather than run."""
    grids: list[tuple[int, ...]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **kwargs: grids.append(grid)

    monkeypatch.setattr(attention, "_decode_attention_kernel", Recorder())
    return grids

@pytest.mark.parametrize(
    ("split_s", "max_splits", "grid"),
    [(16, 64, (3, 2, 5)), (16, 2, (3, 2, 2)), (128, 64, (3, 2, 1))],
    ids=["split", "capped", "single"],
)
def test_decode_attention_launch_reads_no_values(
    split_s: int, max_splits: int, grid: tuple[int, ...], launched: list[tuple[int, ...]]
) -> None:
    """The launch depends on shapes and the config only (so it can be captured in a CUDA
    graph): on meta tensors, where reading any value raises, with the kernel recorded
    rather than run, it launches one grid of min(cdiv(S, split_s), max_splits) pieces."""
    q = torch.empty(3, 8, 16, device="meta")
    k = torch.empty(3, 70, 2, 16, device="meta")
    seq_lens = torch.empty(3, dtype=torch.int64, device="meta")
    config = AttentionConfig(block_s=8, split_s=split_s, max_splits=max_splits)
    out = decode_attention(q, k, k, seq_lens, config=config)
    assert out.shape == q.shape and launched == [grid]


def test_decode_attention_counts_left_zero() -> None:
    """The last program of each (sequence, KV head) merges and sets its count back to zero,
    so one counts buffer serves call after call (and graph replay after replay)."""
    q, k, v, lens = attention_inputs(3, 8, 2, 16, 70, torch.float32, seed=16)
    counts = attention_counts(3, 2, DEVICE)
    config = AttentionConfig(block_s=8, split_s=8)  # 9 pieces: merged 8 at a time
    for _ in range(2):
        out = decode_attention(q, k, v, lens, config=config, counts=counts)
        torch.testing.assert_close(out, decode_attention_ref(q, k, v, lens), **TOL[torch.float32])
        assert counts.tolist() == [0] * 6
    with pytest.raises(ValueError, match="at least 6 entries"):
        decode_attention(q, k, v, lens, counts=attention_counts(1, 2, DEVICE))
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, k, v, lens, counts=torch.zeros(6, dtype=torch.int64, device=DEVICE))


def test_decode_attention_config_checks() -> None:
    q, k, v, lens = attention_inputs(1, 2, 2, 8, 4, torch.float32, seed=15)
    with pytest.raises(ValueError, match="multiple of block_s"):
        decode_attention(q, k, v, lens, config=AttentionConfig(block_s=16, split_s=24))
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, v, lens, config=AttentionConfig(block_s=12, split_s=24))
    with pytest.raises(ValueError, match="max_splits 0 is not positive"):
        decode_attention(q, k, v, lens, config=AttentionConfig(block_s=8, max_splits=0))


# --- decode attention over a paged pool ------------------------------------------------------


def to_pool(
    k: torch.Tensor, v: torch.Tensor, lens: list[int], block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches [B, S, Hkv, D] (S a whole number of blocks) laid out as pools [n_slots, Hkv, D]
    of blocks in a random order, with two spare blocks -> (k_pool, v_pool, block_tables).
    Every slot no sequence holds (past its length, in a spare) is NaN, and the table entries
    past a sequence's blocks point at a spare: a kernel that reads one returns NaN."""
    B, S, Hkv, D = k.shape
    used = [-(-n // block_size) for n in lens]
    n_blocks = sum(used) + 2
    ids = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full((B, S // block_size), int(ids[-1]), dtype=torch.int32)
    k_pool = torch.full((n_blocks * block_size, Hkv, D), float("nan"), dtype=k.dtype)
    v_pool = k_pool.clone()
    taken = 0
    for b, n in enumerate(lens):
        table[b, : used[b]] = ids[taken : taken + used[b]]
        taken += used[b]
        p = torch.arange(n)
        rows = table[b].long()[p // block_size] * block_size + p % block_size
        k_pool[rows], v_pool[rows] = k[b, :n].cpu(), v[b, :n].cpu()
    return k_pool.to(DEVICE), v_pool.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize(
    ("block_size", "dtype"),
    [(8, torch.float32), (16, torch.float32), (32, torch.bfloat16)],
    ids=["blocks-below-a-step", "blocks-of-a-step", "blocks-above-a-step"],
)
def test_decode_attention_paged(block_size: int, dtype: torch.dtype) -> None:
    """Three sequences (one ending mid-block, one of a single position) in a pool of blocks
    in random order, attended through their block tables in steps of 16 positions and
    pieces of 32: bit for bit the result over contiguous caches of the same length (so the
    same pieces), and the references agree as well."""
    lens = [45, 1, 70]
    s_max = -(-max(lens) // block_size) * block_size
    q, k, v, _ = attention_inputs(3, 4, 2, 16, s_max, dtype, seed=block_size)
    seq_lens = torch.tensor(lens, device=DEVICE)
    k_pool, v_pool, table = to_pool(k, v, lens, block_size, seed=block_size)
    config = AttentionConfig(block_s=16, split_s=32)
    paged = decode_attention(q, k_pool, v_pool, seq_lens, config=config, block_tables=table,
                             block_size=block_size)  # fmt: skip
    assert torch.equal(paged, decode_attention(q, k, v, seq_lens, config=config))
    ref = decode_attention_ref(q, k_pool, v_pool, seq_lens, block_tables=table,
                               block_size=block_size)  # fmt: skip
    assert torch.equal(ref, decode_attention_ref(q, k, v, seq_lens))
    torch.testing.assert_close(paged, ref, **TOL[dtype])


def split_tier(pool: torch.Tensor, first: int, block_size: int, fill: float) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """A pool cut at block `first`: (the pool with those rows `fill`ed, the rows from there
    on as a tensor of their own, the second tier)."""
    host = pool[first * block_size :].clone()
    pool = pool.clone()
    pool[first * block_size :] = fill
    return pool, host


@pytest.mark.parametrize("first", [1, 6], ids=["host-most", "host-some"])
def test_decode_attention_reads_the_host_tier(first: int) -> None:
    """The pool's blocks from `first` on in a second tier (the first tier NaN there): bit for
    bit the one-tier call, split in pieces, and the reference agrees."""
    lens, block_size = [45, 1, 70], 8
    q, k, v, _ = attention_inputs(3, 4, 2, 16, 72, torch.float32, seed=31)
    seq_lens = torch.tensor(lens, device=DEVICE)
    k_pool, v_pool, table = to_pool(k, v, lens, block_size, seed=31)
    config = AttentionConfig(block_s=16, split_s=32)
    want = decode_attention(q, k_pool, v_pool, seq_lens, config=config, block_tables=table,
                            block_size=block_size)  # fmt: skip
    (k_dev, k_host), (v_dev, v_host) = (split_tier(t, first, block_size, float("nan"))
                                        for t in (k_pool, v_pool))  # fmt: skip
    host = HostPages(k_host, v_host, None, None, first)
    got = decode_attention(q, k_dev, v_dev, seq_lens, config=config, block_tables=table,
                           block_size=block_size, host=host)  # fmt: skip
    assert torch.equal(got, want)
    ref = decode_attention_ref(q, k_dev, v_dev, seq_lens, block_tables=table,
                               block_size=block_size, host=host)  # fmt: skip
    torch.testing.assert_close(ref, want, **TOL[torch.float32])
    with pytest.raises(ValueError, match="layout"):
        decode_attention(q, k_dev, v_dev, seq_lens, block_tables=table, block_size=block_size,
                         host=HostPages(k_host.half(), v_host, None, None, first))  # fmt: skip
    with pytest.raises(ValueError, match="needs block_tables"):
        decode_attention(q, k, v, seq_lens, host=host)


def test_decode_attention_paged_launch_reads_no_values(launched: list[tuple[int, ...]]) -> None:
    """Paged, the launch still depends on shapes only (the tables are read on the device):
    on meta tensors, the pieces are cut from max_blocks * block_size positions."""
    q = torch.empty(3, 8, 16, device="meta")
    pool = torch.empty(10 * 8, 2, 16, device="meta")
    seq_lens = torch.empty(3, dtype=torch.int64, device="meta")
    table = torch.empty(3, 9, dtype=torch.int32, device="meta")
    out = decode_attention(q, pool, pool, seq_lens, config=AttentionConfig(block_s=8, split_s=16),
                           block_tables=table, block_size=8)  # fmt: skip
    assert out.shape == q.shape and launched == [(3, 2, 5)]  # cdiv(9 * 8, 16) pieces


def test_decode_attention_paged_checks() -> None:
    q, k, v, _ = attention_inputs(2, 4, 2, 16, 16, torch.float32, seed=17)
    lens = torch.tensor([16, 3], device=DEVICE)
    k_pool, v_pool, table = to_pool(k, v, [16, 3], 8, seed=17)

    def call(**kwargs: object) -> None:
        args = {"block_tables": table, "block_size": 8, "k": k_pool, "v": v_pool} | kwargs
        decode_attention(q, args.pop("k"), args.pop("v"), lens, **args)  # type: ignore[arg-type]

    call()  # the valid call, for the ones below
    with pytest.raises(ValueError, match="int32"):
        call(block_tables=table.long())
    with pytest.raises(ValueError, match="int32 on"):
        call(block_tables=table.to("meta"))
    with pytest.raises(ValueError, match=r"must be \[2, max_blocks\]"):
        call(block_tables=table[:1])
    with pytest.raises(ValueError, match="contiguous rows"):
        call(block_tables=torch.cat([table, table], dim=1)[:, ::2])
    with pytest.raises(ValueError, match="power of two"):
        call(block_size=12)
    with pytest.raises(ValueError, match="power of two"):
        call(block_size=0)
    with pytest.raises(ValueError, match="whole blocks"):
        call(k=k_pool[:-1], v=v_pool[:-1])
    with pytest.raises(ValueError, match="pools"):
        call(k=k, v=v)
    with pytest.raises(ValueError, match="pools"):
        call(k=k_pool, v=v_pool[:, :1])
    with pytest.raises(ValueError, match="without block_tables"):
        decode_attention(q, k, v, lens, block_size=8)


# --- real shapes on a GPU ---------------------------------------------------------------------


@pytest.mark.gpu
def test_misc_kernels_real_shapes_gpu() -> None:
    gate, up = torch.randn(2, 8, 1408, device="cuda", dtype=torch.bfloat16).unbind(0)
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), **TOL[torch.bfloat16])
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(1000, 1008, device="cuda")
    inv_freq = rope_inv_freq(128, 1e6, "cuda")
    for style in RopeStyle:
        torch.testing.assert_close(
            rope(q, positions, inv_freq, style),
            rope_ref(q, positions, inv_freq, style),
            **TOL[torch.bfloat16],
        )
    k = torch.randn(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([4096, 1, 1000, 3333], device="cuda")
    qd = q[:4]
    torch.testing.assert_close(
        decode_attention(qd, k, v, lens),
        decode_attention_ref(qd, k, v, lens),
        **TOL[torch.bfloat16],
    )


@pytest.mark.gpu
def test_decode_attention_engine_config_long_cache_gpu() -> None:
    """The offload engine's decode attention on a3b's heads over a 32K static cache, 1K long."""
    from kernels.tuning.configs import KernelConfigs

    engine = KernelConfigs().attention

    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32784, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for n in (1, 1024, 32784):
        lens = torch.tensor([n], device="cuda")
        torch.testing.assert_close(
            decode_attention(q, k, v, lens, config=engine),
            decode_attention_ref(q, k, v, lens),
            **TOL[torch.bfloat16],
        )


@pytest.mark.gpu
def test_decode_attention_paged_gpu() -> None:
    """a3b's heads, eight sequences up to 1,500 positions long in a pool of 32-position
    blocks in random order: against the reference, and bit for bit the contiguous call,
    with the default and the engine's config."""
    from kernels.tuning.configs import KernelConfigs

    lens = [1500, 1, 31, 32, 33, 700, 1023, 1489]
    q, k, v, _ = attention_inputs(8, 32, 4, 128, 47 * 32, torch.bfloat16, seed=18)
    seq_lens = torch.tensor(lens, device=DEVICE)
    k_pool, v_pool, table = to_pool(k, v, lens, 32, seed=18)
    expected = decode_attention_ref(q, k_pool, v_pool, seq_lens, block_tables=table,
                                    block_size=32)  # fmt: skip
    for config in (AttentionConfig(), KernelConfigs().attention):
        paged = decode_attention(q, k_pool, v_pool, seq_lens, config=config, block_tables=table,
                                 block_size=32)  # fmt: skip
        torch.testing.assert_close(paged, expected, **TOL[torch.bfloat16])
        assert torch.equal(paged, decode_attention(q, k, v, seq_lens, config=config))
