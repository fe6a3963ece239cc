"""The fused MoE kernel (experts found through an address table) against its reference."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kernels.experts.moe import (
    ExpertFormat,
    GluClamp,
    MoeConfig,
    expert_table,
    fused_moe,
    fused_moe_ref,
    split_mxfp4,
    split_mxfp4_ok,
    split_q4_0,
    split_q4_0_ok,
    split_q6_k,
    unsplit_mxfp4,
    unsplit_q4_0,
)
from kernels.formats.quant import QTensor, QType, block_geometry, quantize
from tests.sm90_compile import compile_case


def _q4_0(rows: int, cols: int, gen: torch.Generator, device: str) -> QTensor:
    values = torch.randn(rows, cols, generator=gen) / cols**0.5
    raw = gguf_quants.quantize(values.numpy(), GGMLQuantizationType.Q4_0)
    data = torch.from_numpy(raw).to(device)
    return QTensor(data, QType.Q4_0, (rows, cols))


def _case(t: int, k: int, e: int, h: int, f: int, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    experts = [
        (_q4_0(f, h, gen, device), _q4_0(f, h, gen, device), _q4_0(h, f, gen, device))
        for _ in range(e)
    ]
    x = torch.randn(t, h, generator=gen).to(device)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    weights = torch.rand(t, k, generator=gen).to(device)
    split = [tuple(split_q4_0(w.data) for w in triple) for triple in experts]
    table = expert_table(split).to(device)  # type: ignore[arg-type]
    _KEEP.append(split)  # the table holds raw addresses: keep the bytes alive
    return x, ids, weights, table, experts


_KEEP: list[object] = []


@pytest.mark.parametrize(
    ("t", "k", "e", "h", "f", "aligned"),
    [(1, 2, 4, 64, 96, False), (3, 2, 5, 96, 32, False), (2, 4, 8, 256, 160, True)],
)
def test_fused_moe_matches_reference(
    t: int, k: int, e: int, h: int, f: int, aligned: bool
) -> None:
    x, ids, weights, table, experts = _case(t, k, e, h, f, "cpu")
    got = fused_moe(x, ids, weights, table, f, aligned=aligned)  # each matrix a tensor
    ref = fused_moe_ref(x, ids, weights, experts)
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_mixed_tiers_same_result() -> None:
    """Half the experts in one buffer, half in a copy elsewhere: same output."""
    x, ids, weights, table, experts = _case(2, 2, 4, 64, 64, "cpu", seed=3)
    a = [tuple(split_q4_0(w.data) for w in triple) for triple in experts]
    b = [tuple(t.clone() for t in triple) for triple in a]
    mixed = expert_table([b[i] if i % 2 else a[i] for i in range(len(a))])  # type: ignore[misc]
    assert torch.equal(fused_moe(x, ids, weights, table, 64), fused_moe(x, ids, weights, mixed, 64))


def test_split_mxfp4_round_trip() -> None:
    """MXFP4's split layout: the codes first (on 16 bytes where the matrix is), then the
    exponents; the blocks come back bit for bit."""
    w = _blocks(QType.MXFP4, 6, 96, torch.Generator().manual_seed(3))
    split = split_mxfp4(w.data)
    assert split.numel() == w.data.numel()
    blocks = w.data.view(6, 3, 17)
    assert torch.equal(split[: 6 * 3 * 16].view(6, 3, 16), blocks[:, :, 1:])
    assert torch.equal(split[6 * 3 * 16 :].view(6, 3), blocks[:, :, 0])
    assert torch.equal(unsplit_mxfp4(split, 6, 96), w.data)
    assert torch.equal(unsplit_mxfp4(torch.stack([split, split]), 6, 96)[1], w.data)
    # 18 blocks of 17 bytes end off a 16-byte word; gpt-oss's 2880 x 2880 end on one
    assert not split_mxfp4_ok(6, 96) and split_mxfp4_ok(2880, 2880)


def test_split_layout_round_trip() -> None:
    gen = torch.Generator().manual_seed(2)
    w = _q4_0(96, 160, gen, "cpu")
    split = split_q4_0(w.data)
    assert split.numel() == w.data.numel() and split_q4_0_ok(96, 160)
    assert torch.equal(unsplit_q4_0(split, 96, 160), w.data)
    assert not split_q4_0_ok(3, 32)  # 6 bytes of scales: the words would be misaligned


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [False, True])
def test_fused_moe_gpu_real_shape_with_host_mapped_experts(aligned: bool) -> None:
    """a3b geometry; half the experts in VRAM, half read in place from pinned host RAM."""
    x, ids, weights, _, experts = _case(1, 8, 16, 2048, 768, "cpu", seed=5)
    split = [tuple(split_q4_0(w.data) for w in triple) for triple in experts]
    vram = [tuple(t.cuda() for t in triple) for triple in split[:8]]
    host = [tuple(t.pin_memory() for t in triple) for triple in split[8:]]
    table = expert_table(vram + host).cuda()
    got = fused_moe(x.cuda().bfloat16(), ids.cuda(), weights.cuda(), table, 768, aligned=aligned)
    ref = fused_moe_ref(x.bfloat16(), ids, weights, experts)
    err = (got.float().cpu() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_negative_ids_are_skipped() -> None:
    x, ids, weights, table, experts = _case(2, 3, 6, 64, 96, "cpu", seed=7)
    skip = ids.clone()
    skip[0, 1] = -1
    skip[1, 2] = -1
    kept = weights.clone()
    kept[0, 1] = 0.0
    kept[1, 2] = 0.0
    got = fused_moe(x, skip, weights, table, 96)
    ref = fused_moe_ref(x, ids, kept, experts)
    assert (got - ref).norm() / ref.norm() < 1e-5


def _blocks(qtype: QType, rows: int, cols: int, gen: torch.Generator) -> QTensor:
    """Quantized random values; for the i-quants and MXFP4 (no quantizer here) random blocks
    whose leading fp16 scale (MXFP4: E8M0 exponent) is small and finite."""
    fp16_at = {QType.IQ3_S: (0,), QType.IQ4_XS: (0,), QType.IQ4_NL: (0,), QType.Q2_K: (80, 82),
               QType.Q3_K: (108,), QType.IQ3_XXS: (0,), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,),
               QType.IQ2_S: (0,), QType.IQ1_S: (0,), QType.MXFP4: ()}  # fmt: skip
    if qtype in fp16_at:
        block, nbytes = block_geometry(qtype)
        raw = torch.randint(0, 256, (rows * cols // block, nbytes), generator=gen)
        raw = raw.to(torch.uint8)
        for at in fp16_at[qtype]:
            scale = (torch.rand(raw.shape[0], generator=gen) / (4 * cols**0.5)).half()
            raw[:, at : at + 2] = scale.view(torch.uint8).reshape(-1, 2)
        if qtype == QType.MXFP4:  # scales 2^-10..2^-7
            raw[:, 0] = torch.randint(118, 122, (raw.shape[0],), generator=gen)
        return QTensor(raw.reshape(rows, -1), qtype, (rows, cols))
    values = torch.randn(rows, cols, generator=gen) / cols**0.5
    return QTensor(quantize(values, qtype), qtype, (rows, cols))


# (gate, up, down): a Q4_K_M file's mixes (Q6_K down; Q5_0/Q8_0 down where the expert's
# ffn is no multiple of 256), a Q8_0 file, Q4_0 gate/up (split) beside GGUF-block down
MIXES = [
    (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    (QType.Q4_K, QType.Q4_K, QType.Q5_0),
    (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    (QType.Q5_K, QType.Q4_1, QType.Q5_1),
    (QType.Q4_0, QType.Q4_0, QType.Q4_K),
    (QType.IQ3_S, QType.IQ3_S, QType.IQ4_XS),
    (QType.IQ4_NL, QType.IQ4_NL, QType.Q6_K),
    (QType.MXFP4, QType.MXFP4, QType.MXFP4),  # gpt-oss's experts
    (QType.Q5_K, QType.Q5_K, QType.IQ4_XS),
    (QType.Q2_K, QType.Q2_K, QType.Q3_K),
    (QType.IQ2_XXS, QType.IQ3_XXS, QType.IQ2_XS),  # the low-bit i-quants, two mixes for time
    (QType.IQ2_S, QType.IQ1_S, QType.IQ2_XXS),
]


# the types whose dot reads differently when the blobs are aligned (words, 16-byte loads)
WORDS = {QType.Q4_0, QType.Q4_K, QType.Q5_K, QType.IQ4_XS, QType.Q2_K, QType.MXFP4}
CASES = [
    (mix, aligned)
    for mix in MIXES
    for aligned in ((False, True) if WORDS & set(mix) else (True,))
]


def _held(w: QTensor, q6_k_split: bool) -> torch.Tensor:
    """A matrix's bytes as the engine holds them."""
    if w.qtype == QType.Q4_0:
        return split_q4_0(w.data)
    if w.qtype == QType.MXFP4:
        return split_mxfp4(w.data)
    if w.qtype == QType.Q6_K and q6_k_split:
        return split_q6_k(w.data)
    return w.data.reshape(-1)


def _mixed_case(mix: tuple[QType, QType, QType], t: int, k: int, e: int, h: int, f: int,
                device: str, q6_k_split: bool = False):  # type: ignore[no-untyped-def]
    """e random experts of the mix (on the CPU) and the table of their bytes on `device` as
    the engine holds them (Q4_0 split, with q6_k_split Q6_K too, the others as blocks), t
    tokens routed to k each."""
    gen = torch.Generator().manual_seed(11)
    shapes = ((f, h), (f, h), (h, f))
    experts = [
        tuple(_blocks(q, r, c, gen) for q, (r, c) in zip(mix, shapes, strict=True))
        for _ in range(e)
    ]
    held = [
        tuple(_held(w, q6_k_split).to(device) for w in tr)
        for tr in experts
    ]  # fmt: skip
    _KEEP.append(held)  # the table holds raw addresses: keep the bytes alive
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    return x, ids, weights, expert_table(held).to(device), experts  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mix", "aligned"), CASES, ids=lambda c: "-".join(q.name for q in c) if isinstance(c, tuple)
    else ("aligned" if c else "unaligned"),
)  # fmt: skip
def test_fused_moe_mixed_types(mix: tuple[QType, QType, QType], aligned: bool) -> None:
    """Each projection of its own GGUF type, read as the engine holds it (Q4_0 split, the
    others as blocks; aligned: Q4_K's nibbles as words): equal to dequantizing the blocks and
    computing in float32."""
    f = 256 if block_geometry(mix[2])[0] == 256 else 96
    x, ids, weights, table, experts = _mixed_case(mix, 2, 2, 3, 256, f, "cpu")
    assert all(int(a) % 16 == 0 for a in table.reshape(-1)) or not aligned
    got = fused_moe(x, ids, weights, table, f, aligned=aligned, fmt=ExpertFormat(*mix))
    ref = fused_moe_ref(x, ids, weights, experts)
    assert (got - ref).norm() / ref.norm() < 1e-5


def _biases(e: int, h: int, f: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(e, 2, f, generator=gen).to(device),
            torch.randn(e, h, generator=gen).to(device))  # fmt: skip


@pytest.mark.parametrize(("mix", "t", "config"), [
    ((QType.MXFP4,) * 3, 1, MoeConfig()),  # gpt-oss's experts, one token
    ((QType.MXFP4,) * 3, 3, MoeConfig(group_pairs=True)),  # several, grouped by expert
    ((QType.Q8_0,) * 3, 2, MoeConfig(int8_dots=True, group_pairs=False)),  # the int8 dots
], ids=["mxfp4-1", "mxfp4-grouped", "q8_0-int8"])  # fmt: skip
def test_biases_and_clamped_swiglu(
    mix: tuple[QType, QType, QType], t: int, config: MoeConfig
) -> None:
    """gpt-oss's experts: biases on every projection, the clamped SwiGLU (a limit the random
    values cross); two tokens share an expert where grouped."""
    x, ids, weights, table, experts = _mixed_case(mix, t, 2, 3, 256, 64, "cpu")
    x = x * 8  # gate and up past the limit of 7 somewhere
    biases, clamp = _biases(3, 256, 64, "cpu"), GluClamp(alpha=1.702, limit=7.0)
    got = fused_moe(x, ids, weights, table, 64, config, aligned=True, fmt=ExpertFormat(*mix),
                    biases=biases, clamp=clamp)  # fmt: skip
    int8 = (config.int8_dots,) * 3
    ref = fused_moe_ref(x, ids, weights, experts, int8, biases, clamp)
    assert (got - ref).norm() / ref.norm() < 1e-5
    plain = fused_moe_ref(x, ids, weights, experts, int8)
    assert (plain - ref).norm() / ref.norm() > 0.1  # the biases and the clamp count


def test_biases_and_clamped_swiglu_compile_for_sm90() -> None:
    out = compile_case("moe")
    assert "_gate_up_kernel: " in out and "_down_kernel: " in out, out


def test_expert_biases_must_match_the_table() -> None:
    x, ids, weights, table, _ = _mixed_case((QType.Q8_0,) * 3, 1, 2, 3, 256, 64, "cpu")
    gate_up, down = _biases(3, 256, 64, "cpu")
    with pytest.raises(ValueError, match="float32"):
        fused_moe(x, ids, weights, table, 64, fmt=ExpertFormat(*(QType.Q8_0,) * 3),
                  biases=(gate_up[:, 0], down))  # fmt: skip


@pytest.mark.gpu
def test_biases_and_clamped_swiglu_gpu() -> None:
    """gpt-oss-20b's expert shapes (hidden and ffn 2880, MXFP4, top 4 of 32), bfloat16."""
    mix = (QType.MXFP4,) * 3
    x, ids, weights, table, experts = _mixed_case(mix, 8, 4, 32, 2880, 2880, "cuda")
    biases, clamp = _biases(32, 2880, 2880, "cuda"), GluClamp()
    ref = fused_moe_ref(x.bfloat16(), ids, weights, experts, biases=biases, clamp=clamp)
    got = fused_moe(x.cuda().bfloat16(), ids.cuda(), weights.cuda(), table, 2880,
                    aligned=True, fmt=ExpertFormat(*mix), biases=biases, clamp=clamp)  # fmt: skip
    assert (got.float().cpu() - ref.float()).norm() / ref.float().norm() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mix", MIXES, ids=lambda c: "-".join(q.name for q in c))
def test_fused_moe_mixed_types_gpu(mix: tuple[QType, QType, QType]) -> None:
    """Every mix on a GPU at a3b's expert shapes (hidden 2048, ffn 768, top-8 of 16), bfloat16
    activations, the blobs read as words where the type has such a path and byte by byte."""
    x, ids, weights, table, experts = _mixed_case(mix, 1, 8, 16, 2048, 768, "cuda")
    ref = fused_moe_ref(x.bfloat16(), ids, weights, experts).float()
    for aligned in (False, True):
        got = fused_moe(x.cuda().bfloat16(), ids.cuda(), weights.cuda(), table, 768,
                        aligned=aligned, fmt=ExpertFormat(*mix))  # fmt: skip
        err = (got.float().cpu() - ref).norm() / ref.norm()
        assert err < 1e-2, f"aligned={aligned}: relative error {err:.2e}"


def test_expert_format_refuses_a_type_without_a_kernel() -> None:
    with pytest.raises(ValueError, match="F16"):
        ExpertFormat(QType.Q4_K, QType.Q4_K, QType.F16)


def _routed(t: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t tokens routed to k of e experts each (e small: tokens share experts), weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    return ids, torch.rand(t, k, generator=gen)


@pytest.mark.parametrize(
    ("mix", "t", "super_blocks", "group"),
    [
        ((QType.Q4_K, QType.Q4_K, QType.Q6_K), 3, 2, True),
        ((QType.Q4_0, QType.Q4_0, QType.Q8_0), 5, 1, True),
        ((QType.Q4_K, QType.Q4_K, QType.Q6_K), 3, 1, False),
    ],
    ids=["q4_k_m-t3", "q4_0-t5", "q4_k_m-t3-ungrouped"],
)
def test_grouped_tokens_equal_alone(
    mix: tuple[QType, QType, QType], t: int, super_blocks: int, group: bool
) -> None:
    """Several tokens routed to shared experts (the batched decode's shape): the kernels read
    each expert once for all of its tokens (or, ungrouped, a program per pair), and every
    token's output is bit for bit the one it gets alone, and the reference's."""
    x, _, _, table, experts = _mixed_case(mix, 1, 2, 3, 512, 256, "cpu")
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(t))
    ids, weights = _routed(t, 2, 3, seed=t)
    ids[1, 0] = -1  # computed elsewhere: skipped, its neighbours unchanged
    # wide programs: the interpreter's time goes with their count, the grouping does not
    cfg = MoeConfig(block_n=128, super_blocks=super_blocks, group_pairs=group)
    fmt = ExpertFormat(*mix)
    got = fused_moe(x, ids, weights, table, 256, cfg, aligned=True, fmt=fmt)
    for i in range(t):
        alone = fused_moe(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], table, 256, cfg,
                          aligned=True, fmt=fmt)  # fmt: skip
        assert torch.equal(got[i : i + 1], alone), f"token {i} differs from its output alone"
    kept = torch.where(ids >= 0, weights, 0.0)
    ref = fused_moe_ref(x, ids.clamp(min=0), kept, experts)
    assert (got - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("super_blocks", [1, 2, 4])
def test_k_quant_super_blocks_per_step(super_blocks: int) -> None:
    """The K-quant readers take several super-blocks per step, the last step masked where the
    row's super-blocks do not fill it (768 columns: 3 super-blocks)."""
    mix = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
    x, ids, weights, table, experts = _mixed_case(mix, 2, 2, 3, 768, 256, "cpu")
    cfg = MoeConfig(block_n=128, super_blocks=super_blocks)
    got = fused_moe(x, ids, weights, table, 256, cfg, aligned=True, fmt=ExpertFormat(*mix))
    ref = fused_moe_ref(x, ids, weights, experts)
    assert (got - ref).norm() / ref.norm() < 1e-5


def test_super_blocks_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        MoeConfig(super_blocks=3)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 33])
@pytest.mark.parametrize("super_blocks", [1, 8])
@pytest.mark.parametrize("group", [True, False], ids=["grouped", "ungrouped"])
def test_grouped_q4_k_m_gpu(t: int, super_blocks: int, group: bool) -> None:
    """a3b's expert shapes in the Q4_K_M mix, t tokens over 16 experts (shared), bfloat16:
    each token's output alone is bit for bit its output in the batch, near the reference."""
    mix = (QType.Q4_K, QType.Q4_K, QType.Q6_K)
    x, _, _, table, experts = _mixed_case(mix, 1, 8, 16, 2048, 768, "cuda")
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(t)).bfloat16()
    ids, weights = _routed(t, 8, 16, seed=t)
    cfg = MoeConfig(super_blocks=super_blocks, int8_dots=True, group_pairs=group)
    fmt = ExpertFormat(*mix)
    xc, idc, wc = x.cuda(), ids.cuda(), weights.cuda()
    got = fused_moe(xc, idc, wc, table, 768, cfg, aligned=True, fmt=fmt)
    for i in range(t):
        alone = fused_moe(xc[i : i + 1], idc[i : i + 1], wc[i : i + 1], table, 768, cfg,
                          aligned=True, fmt=fmt)  # fmt: skip
        assert torch.equal(got[i : i + 1], alone), f"token {i} differs from its output alone"
    ref = fused_moe_ref(x, ids, weights, experts, int8=(True, True, True)).float()
    err = (got.float().cpu() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"
