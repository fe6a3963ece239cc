"""The CPU expert kernels (kernels/cpu/experts.py, kernels/cpu/*.c) against torch references.

Tolerance. The kernels round each block of 32 activations to int8 (scale amax / 127), so the
references here apply the same rounding in torch (`q8`) and then compute in float64: what is
left is float32 summation order, bounded by a few ulp of the sum of |w| |x| (`_close`). A
second check bounds the kernels against the unrounded float reference by the rounding itself:
each activation moves by at most half its block's scale. The MoE's intermediate activation
(silu(gate) * up) is rounded the same way before the down projection.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.build import CpuKernelsUnavailable
from kernels.cpu.experts import (
    CPU_EXPERT_QTYPES,
    INTERLEAVED_QTYPES,
    X8,
    CpuExpertFormat,
    CpuExperts,
    ExpertExtras,
)
from kernels.experts.moe import split_mxfp4, split_q4_0, split_q6_k
from kernels.formats.quant import FLOAT_QTYPES, QUANTIZE_QTYPES, QType, block_geometry, dequantize

ALL = sorted(CPU_EXPERT_QTYPES, key=lambda t: t.name)
FP16_AT = {QType.IQ3_S: (0,), QType.IQ4_XS: (0,), QType.IQ4_NL: (0,), QType.Q2_K: (80, 82),
           QType.Q3_K: (108,), QType.IQ3_XXS: (0,), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,),
           QType.IQ2_S: (0,), QType.IQ1_S: (0,)}  # fmt: skip
_FLOAT_DTYPE = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu-kernels")


# native: the AVX2 paths where the host has AVX2; portable: the plain C ones, built without
# -march=native (the same results up to float summation order)
@pytest.fixture(scope="module", params=["native", "portable"])
def cpu(request: pytest.FixtureRequest, cache: Path) -> CpuExperts:
    return CpuExperts(threads=2, cache_dir=cache, native=request.param == "native")


@functools.cache  # the native and portable runs share inputs (read only)
def blocks(qtype: QType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes]: quantized random values, or for the types without a
    quantizer here random blocks with small finite fp16 scales (MXFP4: E8M0 exponents)."""
    gen = torch.Generator().manual_seed(seed)
    if qtype in FP16_AT or qtype not in QUANTIZE_QTYPES | FLOAT_QTYPES:
        block, nbytes = block_geometry(qtype)
        raw = torch.randint(0, 256, (rows * cols // block, nbytes), generator=gen)
        raw = raw.to(torch.uint8)
        for at in FP16_AT.get(qtype, ()):
            scale = (torch.rand(raw.shape[0], generator=gen) / (4 * cols**0.5)).half()
            raw[:, at : at + 2] = scale.view(torch.uint8).reshape(-1, 2)
        if qtype == QType.MXFP4:  # scales 2^-10..2^-4
            raw[:, 0] = torch.randint(118, 125, (raw.shape[0],), generator=gen)
        return raw.reshape(rows, -1)
    values = torch.randn(rows, cols, generator=gen) / cols**0.5
    if qtype in FLOAT_QTYPES:
        return values.to(_FLOAT_DTYPE[qtype]).view(torch.uint8).reshape(rows, -1)
    from kernels.formats.quant import quantize

    return quantize(values, qtype).reshape(rows, -1)


def dense(raw: torch.Tensor, qtype: QType, rows: int, cols: int) -> torch.Tensor:
    return dequantize(raw.reshape(-1), qtype, (rows, cols)).double()


def q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round activations: int8 per block of 32, C's roundf."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.sign(v) * torch.floor(v.abs() + 0.5) * d).reshape(x.shape)


def _act(x: torch.Tensor, qtype: QType) -> torch.Tensor:
    return x if qtype in FLOAT_QTYPES else q8(x)


def _close(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, ulps: float = 64) -> None:
    """|got - ref| within `ulps` float32 ulps of `scale` (the sum of |w| |x| per output)."""
    err = (got.double() - ref).abs()
    bound = ulps * 2**-24 * scale + 1e-30
    assert bool((err <= bound).all()), f"max excess {(err / bound).max():.2f}"


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_matmul_matches_torch(cpu: CpuExperts, qtype: QType) -> None:
    rows, cols = 24, 512
    raw = blocks(qtype, rows, cols, seed=int(qtype))
    w = dense(raw, qtype, rows, cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    got = cpu.matmul(x, raw, qtype, rows, cols)
    xa = _act(x, qtype).double()
    _close(got, xa @ w.T, xa.abs() @ w.abs().T)
    if qtype not in FLOAT_QTYPES:  # against the unrounded input: off by at most the
        # rounding, half a step (block amax / 127) per activation
        half_step = x.reshape(3, -1, 32).abs().amax(-1, keepdim=True) / 254
        half_step = half_step.expand(3, cols // 32, 32).reshape(3, cols).double()
        err = (got.double() - x.double() @ w.T).abs()
        assert bool((err <= 1.001 * (half_step @ w.abs().T) + 1e-6).all())


BLOCK_32 = [QType.Q4_0, QType.Q8_0, QType.IQ4_NL, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.MXFP4]


@pytest.mark.parametrize("qtype", [*BLOCK_32, QType.Q4_K, QType.Q6_K, QType.Q2_K, QType.IQ4_XS,
                                   QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S,
                                   QType.IQ1_S], ids=lambda t: t.name)  # fmt: skip
def test_matmul_many_tokens_and_ragged_rows(cpu: CpuExperts, qtype: QType) -> None:
    # 40 tokens: more than one tile of activations per decoded row; 96 and 288 columns of the
    # 32-value types: a partial 256-value chunk, and blocks past the last group of 8
    for cols in (96, 288) if qtype in BLOCK_32 else (512,):
        raw = blocks(qtype, 9, cols, seed=3)
        w = dense(raw, qtype, 9, cols)
        x = torch.randn(40, cols, generator=torch.Generator().manual_seed(2))
        out = torch.full((40, 9), float("nan"))
        cpu.matmul(x, raw, qtype, 9, cols, out=out)
        xa = q8(x).double()
        _close(out, xa @ w.T, xa.abs() @ w.abs().T)


def _host_has(*flags: str) -> bool:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(f in words for f in flags)


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED_QTYPES, key=lambda t: t.name),
                         ids=lambda t: t.name)  # fmt: skip
def test_interleaved_rows_match_torch(cpu: CpuExperts, qtype: QType) -> None:
    # rows interleaved in eights (kernels/cpu/interleave.h): two groups; 1-9 tokens cover a
    # tile of each size (1-4) and several tiles; three blocks a group (two of Q4_K's 256)
    grows = {QType.Q4_0: (32, 2), QType.Q4_K: (256, 4), QType.Q6_K: (256, 0)}
    rows, (values, grown) = 16, grows.get(qtype, (32, 0))
    cols = 3 * values if values == 32 else 2 * values
    raw = blocks(qtype, rows, cols, seed=7)
    w = dense(raw, qtype, rows, cols)
    read, code = cpu.interleave(raw, qtype, rows, cols)
    # the native build on an AVX2 host reads the layout; the portable one keeps GGUF rows
    assert cpu.interleaves == (cpu.native and _host_has("avx2", "f16c"))
    # the layout's size: Q4_0's offsets and Q4_K's unpacked scales add bytes per row and block
    assert (code == int(qtype) | X8 and read.numel() == raw.numel() + grown * rows * cols //
            values) if cpu.interleaves else (code == int(qtype) and read is raw)  # fmt: skip
    prepared = cpu.prepare(raw, qtype, rows, cols)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(3))
    for t in (1, 2, 3, 4, 5, 9):
        got = prepared(x[:t])
        xa = q8(x[:t]).double()
        _close(got, xa @ w.T, xa.abs() @ w.abs().T)
        # a token's outputs are the same bits whatever else shares the call
        assert torch.equal(got[t - 1 :], prepared(x[t - 1 : t]))


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED_QTYPES, key=lambda t: t.name),
                         ids=lambda t: t.name)  # fmt: skip
def test_two_groups_at_once_give_each_groups_bits(cpu: CpuExperts, qtype: QType) -> None:
    # 24 rows: the first two groups of eight may go together (512-bit registers where the
    # host has AVX-512 VNNI), the third alone; each group's rows give the bits they give as a
    # matrix of one group (the 8-row path), for 1-9 tokens
    rows, cols = 24, 96 if qtype in BLOCK_32 else 256
    raw = blocks(qtype, rows, cols, seed=11)
    whole = cpu.prepare(raw, qtype, rows, cols)
    alone = [cpu.prepare(raw[8 * g : 8 * g + 8].contiguous(), qtype, 8, cols) for g in range(3)]
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(5))
    for t in (1, 3, 4, 9):
        assert torch.equal(whole(x[:t]), torch.cat([p(x[:t]) for p in alone], dim=1))


def test_the_interleaved_flag_and_types_are_the_kernels(cpu: CpuExperts) -> None:
    header = (Path(__file__).parents[1] / "kernels" / "cpu" / "interleave.h").read_text()
    assert f"#define X8_FLAG (1 << {X8.bit_length() - 1})" in header and X8 == 1 << 10
    # the C side sizes the layout of exactly the types Python names (either build)
    laid_out = {q for q in CPU_EXPERT_QTYPES if cpu.interleaved_bytes(q, 8, 256) >= 0}
    assert laid_out == INTERLEAVED_QTYPES
    assert cpu.interleaved_bytes(QType.Q4_1, 12, 256) == -2  # rows not in eights


def test_interleave_keeps_what_it_cannot_interleave(cpu: CpuExperts) -> None:
    raw = blocks(QType.Q4_1, 12, 64, seed=1)  # 12 rows: not groups of eight
    assert cpu.interleave(raw, QType.Q4_1, 12, 64) == (raw, int(QType.Q4_1))
    raw = blocks(QType.Q5_0, 8, 64, seed=1)  # a type without the layout
    assert cpu.interleave(raw, QType.Q5_0, 8, 64) == (raw, int(QType.Q5_0))
    # a Q4_0 scale of 2^14: its offset -8 d is no fp16 (-4 from C), so the rows stay as they are
    raw = blocks(QType.Q4_0, 8, 64, seed=1).clone()
    raw[3, :2] = torch.tensor([0x00, 0x74], dtype=torch.uint8)  # fp16 16384
    read, code = cpu.interleave(raw, QType.Q4_0, 8, 64)
    assert code == int(QType.Q4_0) and read is raw
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    xa = q8(x).double()
    w = dense(raw, QType.Q4_0, 8, 64)
    _close(cpu.prepare(raw, QType.Q4_0, 8, 64)(x), xa @ w.T, xa.abs() @ w.abs().T)


@functools.cache
def _blob(fmt: CpuExpertFormat, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A blob of `fmt` (plus 3 spare bytes) and its float64 (gate, up, down)."""
    shapes = ((fmt.ffn, fmt.hidden), (fmt.ffn, fmt.hidden), (fmt.hidden, fmt.ffn))
    parts, dense_parts = [], []
    for k, (qtype, (rows, cols)) in enumerate(zip(fmt.qtypes, shapes, strict=True)):
        raw = blocks(qtype, rows, cols, seed=seed * 3 + k)
        dense_parts.append(dense(raw, qtype, rows, cols))
        if fmt.q4_0_split and qtype == QType.Q4_0:
            parts.append(split_q4_0(raw))
        elif fmt.q6_k_split and qtype == QType.Q6_K:
            parts.append(split_q6_k(raw))
        elif fmt.mxfp4_split and qtype == QType.MXFP4:
            parts.append(split_mxfp4(raw))
        else:
            parts.append(raw.reshape(-1))
    parts.append(torch.zeros(3, dtype=torch.uint8))
    return torch.cat(parts), dense_parts


def moe_ref(x, experts, tokens, weights, qtypes):  # type: ignore[no-untyped-def]
    out = torch.zeros(x.shape, dtype=torch.float64)
    scale = torch.zeros(x.shape, dtype=torch.float64)
    for (g, u, d), t, w in zip(experts, tokens, weights, strict=True):
        xa = _act(x[t], qtypes[0]).double()
        h = F.silu(g @ xa) * (u @ xa)
        ha = _act(h.float(), qtypes[2]).double()
        out[t] += w * (d @ ha)
        scale[t] += abs(w) * (d.abs() @ ha.abs())
    return out, scale


MIXES = [
    (QType.Q4_0, QType.Q4_0, QType.Q4_0),
    (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    (QType.Q4_K, QType.Q4_K, QType.Q5_0),
    (QType.Q5_K, QType.Q4_1, QType.Q5_1),
    (QType.Q2_K, QType.Q2_K, QType.Q3_K),
    (QType.IQ3_S, QType.IQ3_S, QType.IQ4_XS),
    (QType.IQ2_XXS, QType.IQ3_XXS, QType.IQ2_XS),
    (QType.IQ2_S, QType.IQ1_S, QType.IQ2_XXS),
    (QType.IQ4_NL, QType.Q4_0, QType.F16),
    (QType.MXFP4, QType.MXFP4, QType.MXFP4),  # gpt-oss's experts
    (QType.BF16, QType.F32, QType.Q8_0),
]


# the split layouts change only Q4_0, Q6_K and MXFP4 projections
CASES = [(m, False) for m in MIXES] + [
    (m, True) for m in MIXES if {QType.Q4_0, QType.Q6_K, QType.MXFP4} & set(m)
]


@pytest.mark.parametrize(
    ("qtypes", "split"),
    CASES,
    ids=[f"{'-'.join(q.name for q in m)}{'-split' * s}" for m, s in CASES],
)
def test_moe_matches_torch(cpu: CpuExperts, qtypes: tuple[QType, QType, QType],
                           split: bool) -> None:  # fmt: skip
    _check_moe(cpu, qtypes, split)


@pytest.mark.parametrize("qtypes", [MIXES[0], MIXES[10]], ids=["Q4_0", "MXFP4"])
def test_split_layouts_portable(qtypes: tuple[QType, QType, QType]) -> None:
    """The portable build (no AVX2: the decode-then-dot path, not the fused dots) reads the
    split layouts too."""
    _check_moe(CpuExperts(2, native=False), qtypes, True)


def test_moe_with_biases_and_the_clamp(cpu: CpuExperts) -> None:
    """gpt-oss's experts (split MXFP4): each item's gate, up and down biases and the clamped
    SwiGLU, against float64 on the same int8 activations; a limit the products pass clamps."""
    fmt = CpuExpertFormat.packed((QType.MXFP4,) * 3, hidden=256, ffn=256, mxfp4_split=True)
    made = [_blob(fmt, seed) for seed in range(2)]
    gen = torch.Generator().manual_seed(8)
    items, tokens, weights = [0, 1, 0], [0, 0, 1], [0.5, -1.5, 2.0]
    x = torch.randn(2, 256, generator=gen)
    extras = ExpertExtras(torch.randn(3, 2, 256, generator=gen), torch.randn(3, 256, generator=gen),
                          (1.702, 0.5))  # fmt: skip
    out = torch.zeros(2, 256)
    cpu.moe(x, [made[e][0] for e in items], tokens, weights, fmt, out, extras)
    ref, scale = torch.zeros(2, 256, dtype=torch.float64), torch.zeros(2, 256, dtype=torch.float64)
    clamped = 0
    for i, (e, t, w) in enumerate(zip(items, tokens, weights, strict=True)):
        g, u, d = made[e][1]
        xa = _act(x[t], QType.MXFP4).double()
        bias = extras.gate_up_bias[i].double()  # type: ignore[index]
        gate, up = (g @ xa + bias[0]).clamp(max=0.5), (u @ xa + bias[1]).clamp(-0.5, 0.5)
        clamped += int((g @ xa + bias[0] > 0.5).sum())
        ha = _act((gate * torch.sigmoid(1.702 * gate) * (up + 1)).float(), QType.MXFP4).double()
        ref[t] += w * (d @ ha + extras.down_bias[i].double())  # type: ignore[index]
        scale[t] += abs(w) * (d.abs() @ ha.abs() + extras.down_bias[i].abs().double())  # type: ignore[index]
    assert clamped > 0
    _close(out, ref, scale, ulps=256)
    with pytest.raises(ValueError, match="down_bias"):
        cpu.moe(x, [made[0][0]], [0], [1.0], fmt, out, ExpertExtras(down_bias=torch.zeros(2, 256)))


def _check_moe(cpu: CpuExperts, qtypes: tuple[QType, QType, QType], split: bool) -> None:
    fmt = CpuExpertFormat.packed(qtypes, hidden=256, ffn=256, q4_0_split=split, q6_k_split=split,
                                 mxfp4_split=split)  # fmt: skip
    made = [_blob(fmt, seed) for seed in range(3)]
    # the blobs at odd byte offsets in one tensor
    store = torch.cat([torch.zeros(1, dtype=torch.uint8)] + [b for b, _ in made])
    step = made[0][0].numel()
    blobs = [store[1 + e * step : 1 + e * step + fmt.nbytes] for e in range(3)]
    # 4 tokens; experts repeated across tokens (0 thrice), items out of token order
    items = [(0, 0), (1, 0), (0, 1), (2, 2), (3, 0), (1, 1), (3, 2)]
    tokens = [t for t, _ in items]
    weights = [0.5, -0.25, 1.0, 0.75, 0.3, 2.0, 0.125]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    out = torch.ones(4, 256)
    cpu.moe(x, [blobs[e] for _, e in items], tokens, weights, fmt, out)
    ref, scale = moe_ref(x, [made[e][1] for _, e in items], tokens, weights, qtypes)
    _close(out - 1, ref, scale, ulps=256)
    if not split:  # the same experts as three slices each (the store's parts): the same sums
        u, d = fmt.up_offset, fmt.down_offset
        parts = [(b[:u], b[u:d], b[d : fmt.nbytes]) for b in blobs]
        got = torch.ones(4, 256)
        cpu.moe_parts(x, [parts[e] for _, e in items], tokens, weights, qtypes, 256, got)
        assert torch.equal(got, out)


@pytest.mark.parametrize("qtypes", [MIXES[2], MIXES[4]], ids=lambda m: "-".join(q.name for q in m))
def test_moe_from_stacks_matches_torch(cpu: CpuExperts, qtypes: tuple[QType, ...]) -> None:
    """`prepare_moe`: a layer's experts read from the model's three stacks (the down stack's
    type, so its stride, differs from gate's), all of a step's routes in one call."""
    e, hidden, ffn = 3, 256, 256
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    made = [[blocks(q, r, c, seed=9 * i + k) for i in range(e)]
            for k, (q, (r, c)) in enumerate(zip(qtypes, shapes, strict=True))]  # fmt: skip
    stacks = [torch.stack(m) for m in made]  # [E, rows, row bytes]
    moe = cpu.prepare_moe(*stacks, (qtypes[0], qtypes[1], qtypes[2]), hidden, ffn)
    ids = torch.tensor([[0, 2], [1, 0], [2, 2]])  # 3 tokens, top-2 (a repeated route too)
    weights = torch.tensor([[0.5, -0.25], [1.0, 0.75], [0.3, 2.0]])
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5))
    out = torch.ones(3, hidden)
    moe(x, ids, weights, out)
    experts = [[dense(made[k][i], q, r, c) for k, (q, (r, c)) in enumerate(zip(qtypes, shapes,
                                                                               strict=True))]
               for i in ids.flatten().tolist()]  # fmt: skip
    tokens = [t for t in range(3) for _ in range(2)]
    ref, scale = moe_ref(x, experts, tokens, weights.flatten().tolist(), qtypes)
    _close(out - 1, ref, scale, ulps=256)
    with pytest.raises(ValueError, match="expert ids"):
        moe(x, ids + 1, weights, out)


def test_moe_split_q4_0_ragged_rows(cpu: CpuExperts) -> None:
    # ffn 288: the down rows end with a block past the last group of 8
    qtypes = (QType.Q4_0, QType.Q4_0, QType.Q4_0)
    fmt = CpuExpertFormat.packed(qtypes, hidden=256, ffn=288, q4_0_split=True)
    blob, (g, u, d) = _blob(fmt, 11)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    out = torch.zeros(2, 256)
    cpu.moe(x, [blob, blob], [1, 0], [0.5, 1.5], fmt, out)
    ref, scale = moe_ref(x, [(g, u, d)] * 2, [1, 0], [0.5, 1.5], qtypes)
    _close(out, ref, scale, ulps=256)


def test_moe_is_deterministic_across_threads(cache: Path) -> None:
    fmt = CpuExpertFormat.packed((QType.Q4_K, QType.Q4_K, QType.Q6_K), hidden=256, ffn=512)
    blobs = [_blob(fmt, seed)[0] for seed in range(5)]
    items = [(t, e) for t in range(3) for e in (t, t + 1, 4)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    outs = []
    for threads in (1, 2, 3):
        out = torch.zeros(3, 256)
        CpuExperts(threads=threads, cache_dir=cache).moe(
            x, [blobs[e] for _, e in items], [t for t, _ in items], [0.1 * e for _, e in items],
            fmt, out,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_torch_keeps_its_threads(cache: Path) -> None:
    # the kernels' OpenMP team size is per call (num_threads), not the process's setting:
    # torch (whose libgomp the library shares) keeps its own
    before = torch.get_num_threads()
    cpu = CpuExperts(threads=1, cache_dir=cache)
    raw = blocks(QType.Q8_0, 8, 64, seed=0)
    cpu.matmul(torch.ones(1, 64), raw, QType.Q8_0, 8, 64)
    assert torch.get_num_threads() == before
    a = torch.randn(64, 64)
    assert torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-4)


def test_bad_inputs_are_refused(cpu: CpuExperts) -> None:
    fmt = CpuExpertFormat.packed((QType.Q8_0,) * 3, hidden=64, ffn=32)  # type: ignore[arg-type]
    blob = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    x, out = torch.zeros(1, 64), torch.zeros(1, 64)
    with pytest.raises(ValueError, match="tokens must be in"):
        cpu.moe(x, [blob], [1], [1.0], fmt, out)
    with pytest.raises(ValueError, match="holds"):
        cpu.moe(x, [blob[:-1]], [0], [1.0], fmt, out)
    with pytest.raises(TypeError, match="float32"):
        cpu.moe(x.half(), [blob], [0], [1.0], fmt, out)
    with pytest.raises(ValueError, match="blobs"):
        cpu.moe(x, [blob], [0, 0], [1.0], fmt, out)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.moe(torch.zeros(64, 2).T[:1], [blob], [0], [1.0], fmt, out)
    with pytest.raises(ValueError, match="on the CPU"):  # a GPU tensor is refused the same way
        cpu.moe(x.to("meta"), [blob], [0], [1.0], fmt, out)
    with pytest.raises(ValueError, match="blob 0 must be"):
        cpu.moe(x, [blob.to("meta")], [0], [1.0], fmt, out)
    parts = (blob[: fmt.up_offset], blob[fmt.up_offset : fmt.down_offset], blob[fmt.down_offset :])
    with pytest.raises(ValueError, match="expert 0 part 2"):
        cpu.moe_parts(x, [(*parts[:2], parts[2][:-1])], [0], [1.0], fmt.qtypes, 32, out)
    with pytest.raises(ValueError, match="tokens must be in"):
        cpu.moe_parts(x, [parts], [1], [1.0], fmt.qtypes, 32, out)
    with pytest.raises(ValueError, match="do not read IQ1_M"):
        cpu.matmul(x, blob, QType.IQ1_M, 32, 64)
    w = blocks(QType.Q8_0, 32, 64, seed=0)  # a [32, 64] Q8_0 weight
    with pytest.raises(ValueError, match="columns"):
        cpu.matmul(torch.zeros(1, 32), w, QType.Q8_0, 32, 64)
    with pytest.raises(ValueError, match="bytes"):
        cpu.matmul(x, w.reshape(-1)[:-1], QType.Q8_0, 32, 64)
    with pytest.raises(ValueError, match="multiple of the Q4_K block"):
        cpu.matmul(x, blob, QType.Q4_K, 32, 64)


def test_no_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(CpuKernelsUnavailable, match="CC='/nonexistent/cc' was not found"):
        CpuExperts(cache_dir=tmp_path)
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(CpuKernelsUnavailable, match="failed to build"):
        CpuExperts(cache_dir=tmp_path / "x")
