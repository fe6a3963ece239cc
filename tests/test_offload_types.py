"""The offload engine on experts of several GGUF types, mixed per projection and per layer
(as a Q4_K_M file mixes them), against the reference engine on the same file.

Each layer's blobs have their own size and offsets; every tier gives a blob the largest
one's row. The fused kernels read Q4_0 in the split layout and the other types as GGUF
blocks; prefill dequantizes them, the CPU miss path too.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kernels.cpu.experts import CpuExperts
from kernels.formats.quant import QType, row_bytes
from kernels.tuning.configs import INTERPRETED
from stratad.engine.offload.cpu_misses import CompiledMath, TorchMath
from stratad.engine.offload.dense import blocks_saving
from stratad.engine.offload.experts import (
    BlobLayout,
    blob_layouts,
    fast_path_refusal,
    kernel_layouts,
    moe_layers,
)
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.kernel_form import KernelForm
from stratad.engine.offload.projection import GgufMatrix
from stratad.engine.passes import FUSED_MAX_TOKENS
from stratad.engine.placement import offload_supported
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model, ModelError
from stratad.model.synthetic.writer import get_preset, write_synth
from stratad.store.loader import load_model
from stratad.store.tiers.rows import PinnedRows
from stratad.store.tiers.sources import ModelExperts
from stratad.tuning.bench_weights import random_blocks
from tests.gguf_export import export_retyped
from tests.greedy import greedy_logits

# a staged chunk (every expert of a layer dequantized, then grouped GEMMs), then 2 tokens
# through the fused kernels
CHUNK = FUSED_MAX_TOKENS + 1
PROMPT = list(range(100, 100 + CHUNK + 2))

# (gate, up, down) per layer of tiny-moe (hidden 256, expert ffn 128: down's rows of 128
# columns take no 256-value K-quant, as in llama.cpp's fallback)
MIX = [
    (QType.Q4_K, QType.Q4_K, QType.Q8_0),
    (QType.Q6_K, QType.Q6_K, QType.Q4_1),
    (QType.Q5_K, QType.Q4_K, QType.Q4_0),
    (QType.Q4_0, QType.Q4_0, QType.Q4_0),
]


@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory: pytest.TempPathFactory, tiny_moe_file: Path) -> Model:
    root = tmp_path_factory.mktemp("mixed")
    names = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    types = {
        f"blk.{layer}.{name}.weight": qtype
        for layer, mix in enumerate(MIX)
        for name, qtype in zip(names, mix, strict=True)
    }
    export_retyped(tiny_moe_file, root / "mixed.gguf", types)
    return load_model(root / "mixed.gguf")


def test_layouts_follow_each_layer(mixed_moe: Model) -> None:
    layouts = kernel_layouts(mixed_moe)
    assert [lay.qtypes for lay in layouts.layers] == MIX
    sizes = [lay.nbytes for lay in layouts.layers]
    assert len(set(sizes)) > 1 and layouts.slot_bytes >= max(sizes)
    assert layouts.slot_bytes % 16 == 0
    assert offload_supported(mixed_moe)


def test_ram_copies_take_what_the_plan_counts(mixed_moe: Model) -> None:
    """Each RAM copy takes its own layer's size, the stride the store's plan counts for it
    (not the largest layer's), and its row holds the blob's bytes in the kernels' layout."""
    source = ModelExperts(mixed_moe)
    layouts = kernel_layouts(mixed_moe)
    rows = PinnedRows(source, KernelForm(source.layouts, layouts))
    rows.wait()
    try:
        want = [source.layouts[u.layer].stride for u in rows.ram.units]
        assert list(rows.ram.sizes) == want and len(set(want)) > 1
        for layer in range(mixed_moe.spec.n_layers):
            blob = rows.blob(layer, 5)
            assert blob.numel() == layouts.copy_bytes(layer) < layouts.slot_bytes or layer == 1
            gate = layouts[layer].views(blob)[0]
            stored = moe_layers(mixed_moe)[layer].experts.expert(5).gate
            assert torch.equal(gate.dequantize(), stored.dequantize())
    finally:
        rows.close()


@pytest.mark.parametrize(
    ("slots", "gpu_miss", "pcie_frac", "file_tier"),
    [(0, "copy", 1.0, False), (3, "in_place", 0.5, True)],
)
def test_tokens_match_reference(
    mixed_moe: Model, slots: int, gpu_miss: str, pcie_frac: float, file_tier: bool
) -> None:
    """Every tier (VRAM slot, RAM copy, the file) and every miss path (copy, in place, the
    CPU) on mixed types: the reference's tokens."""
    spec = mixed_moe.spec
    ram = (
        [[x for x in range(spec.n_experts) if x % 2 == 0] for _ in range(spec.n_layers)]
        if file_tier
        else None
    )
    budget = slots * spec.n_layers * blob_layouts(mixed_moe).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                        kernels=INTERPRETED, graphs=False, gpu_miss=gpu_miss,
                        pcie_frac=pcie_frac)  # fmt: skip
    off = OffloadForward(mixed_moe, torch.device("cpu"), cfg, ram=ram)
    ref_tokens, ref_logits = greedy_logits(ReferenceForward(mixed_moe), PROMPT, 5)
    tokens, logits = greedy_logits(off, PROMPT, 5)
    assert tokens == ref_tokens
    # the compiled CPU kernels round activations to 8 bits per block of 32, as llama.cpp does
    assert (logits - ref_logits).abs().max() < (0.15 if pcie_frac < 1.0 else 1e-3)
    assert (off.cpu.experts > 0) == (pcie_frac < 1.0)
    assert (off.ram.file_reads > 0) == file_tier


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_split_q6_k_experts_give_the_tokens_of_the_blocks(mixed_moe: Model, device: str) -> None:
    """Layer 1's Q6_K gate/up held in the split layout (`OffloadConfig.q6_k_split`) through
    every tier and path: the fused int8 dots give the logits of the blocks bit for bit (VRAM
    slots, RAM copies, the file; prefill's dequantized chunk), and so do the compiled CPU
    kernels taking every miss; the RAM copy's views are the file's blocks. Without the int8
    dots the setting is refused."""
    spec = mixed_moe.spec
    int8 = replace(INTERPRETED, moe=replace(INTERPRETED.moe, int8_dots=True),
                   moe_down=replace(INTERPRETED.moe_down, int8_dots=True))  # fmt: skip
    ram = [[x for x in range(spec.n_experts) if x % 2 == 0] for _ in range(spec.n_layers)]
    budget = 3 * spec.n_layers * blob_layouts(mixed_moe).slot_bytes

    def engine(split: bool, pcie_frac: float = 1.0) -> OffloadForward:
        cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                            kernels=int8, graphs=False, pcie_frac=pcie_frac,
                            q6_k_split=split)  # fmt: skip
        return OffloadForward(mixed_moe, torch.device(device), cfg, ram=ram)

    split = engine(True)
    assert split.layouts[1].is_split(QType.Q6_K) and split.layouts[1].fmt.q6_k_split
    gate = split.layouts[1].views(split.ram.blob(1, 4))[0]
    assert torch.equal(gate.data, moe_layers(mixed_moe)[1].experts.expert(4).gate.data)
    tokens, logits = greedy_logits(split, PROMPT, 5)
    blocks_tokens, blocks_logits = greedy_logits(engine(False), PROMPT, 5)
    assert tokens == blocks_tokens and torch.equal(logits, blocks_logits)
    assert split.ram.file_reads > 0
    # every miss on the CPU: the C kernels read layer 1's split Q6_K (read as blocks, its
    # bytes give NaN here) with the blocks' arithmetic
    shared = engine(True, pcie_frac=0.0)
    assert not split.layouts[0].q6_k_split  # only a layer holding Q6_K says split
    got = greedy_logits(shared, PROMPT, 2)[1]
    want = greedy_logits(engine(False, pcie_frac=0.0), PROMPT, 2)[1]
    assert shared.cpu.experts > 0 and torch.equal(got, want)
    with pytest.raises(ValueError, match="int8 dots alone"):
        OffloadConfig(expert_vram_bytes=0, kernels=INTERPRETED, q6_k_split=True)


def test_a_type_without_a_kernel_is_named(
    tmp_path_factory: pytest.TempPathFactory, tiny_moe_file: Path
) -> None:
    """Experts the fused kernels cannot read keep the reference engine, and saying why."""
    f16 = tmp_path_factory.mktemp("f16") / "f16.gguf"
    export_retyped(tiny_moe_file, f16, {"blk.2.ffn_down_exps.weight": QType.F16})
    model = load_model(f16)
    assert not offload_supported(model)
    with pytest.raises(ModelError, match="layer 2 holds F16 experts"):
        kernel_layouts(model)


def test_cpu_misses_of_a_low_bit_i_quant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's share of the misses on a layer of IQ2_XXS experts: the C kernels read the
    blocks (no torch dequantizing), within their int8 activations' rounding of torch's."""
    h = f = 256
    q = QType.IQ2_XXS
    nbytes = f * row_bytes(q, h)
    layout = BlobLayout((q, q, q), h, f, nbytes, nbytes, nbytes)
    blobs = [random_blocks(q, 3 * f, h, torch.device("cpu")).reshape(-1) for _ in range(2)]
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(0))
    got, want = torch.zeros(2, h), torch.zeros(2, h)
    TorchMath().moe(x, blobs, [0, 1], [0.5, 0.25], layout, want)
    monkeypatch.setattr(TorchMath, "moe", None)  # the fallback would fail: not taken
    CompiledMath(CpuExperts(1)).moe(x, blobs, [0, 1], [0.5, 0.25], layout, got)
    assert want.abs().sum() > 0 and (got - want).norm() < 0.05 * want.norm()


@pytest.mark.gpu
@pytest.mark.parametrize(("gpu_miss", "file_tier"), [("copy", False), ("in_place", True)])
def test_tokens_match_reference_gpu(mixed_moe: Model, gpu_miss: str, file_tier: bool) -> None:
    """The same on a GPU, graphs and prefetch on where they apply (float32 compute)."""
    spec = mixed_moe.spec
    ram = (
        [[x for x in range(spec.n_experts) if x % 2 == 0] for _ in range(spec.n_layers)]
        if file_tier
        else None
    )
    budget = 3 * spec.n_layers * blob_layouts(mixed_moe).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                        gpu_miss=gpu_miss, prefetch=True)  # fmt: skip
    off = OffloadForward(mixed_moe, torch.device("cuda"), cfg, ram=ram)
    ref_tokens, ref_logits = greedy_logits(ReferenceForward(mixed_moe), PROMPT, 16)
    tokens, logits = greedy_logits(off, PROMPT, 16)
    assert tokens == ref_tokens
    assert (logits.cpu() - ref_logits).abs().max() < 1e-2


@pytest.mark.parametrize("ftype", ["q4_k_m", "q2_k", "iq3_s", "iq2_xxs"])  # Q8_0: the mix
def test_llama_cpp_presets_match_reference(
    ftype: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tiny-moe in the types llama-quantize gives each preset (its fallbacks included: an
    expert ffn of 128 takes no 256-value block): the offload engine serves it, with the
    reference's tokens."""
    from stratad.model.synthetic.ftype_rules import get_ftype

    path = tmp_path_factory.mktemp(ftype) / f"tiny-moe-{ftype}.gguf"
    write_synth(get_preset("tiny-moe"), path, ftype=get_ftype(ftype))
    model = load_model(path)
    assert offload_supported(model), fast_path_refusal(model)
    budget = 3 * model.spec.n_layers * blob_layouts(model).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                        kernels=INTERPRETED, graphs=False)  # fmt: skip
    off = OffloadForward(model, torch.device("cpu"), cfg)
    ref_tokens, ref_logits = greedy_logits(ReferenceForward(model), PROMPT, 3)
    tokens, logits = greedy_logits(off, PROMPT, 3)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() < 1e-3


@pytest.fixture(scope="module")
def quantized_attention(tmp_path_factory: pytest.TempPathFactory, tiny_moe_file: Path) -> Model:
    """tiny-moe with its attention and head in a Q4_K_M file's types: q, k Q4_K; v Q6_K; o
    Q8_0; the output head Q6_K."""
    kinds = {"attn_q": QType.Q4_K, "attn_k": QType.Q4_K, "attn_v": QType.Q6_K,
             "attn_output": QType.Q8_0}  # fmt: skip
    types = {f"blk.{layer}.{k}.weight": q for layer in range(len(MIX)) for k, q in kinds.items()}
    path = tmp_path_factory.mktemp("attn") / "attn.gguf"
    export_retyped(tiny_moe_file, path, {**types, "output.weight": QType.Q6_K})
    return load_model(path)


def test_dense_gguf_decode_reads_the_blocks(quantized_attention: Model) -> None:
    """`dense_gguf`: qkv, o and the head are held as their GGUF blocks alone; a decode pass
    dots them in int8, prefill runs GEMMs over slices dequantized as it goes: the plain
    engine's greedy tokens, and logits within the activations' 8-bit rounding, but not equal
    to them (the blocks were read)."""

    def engine(gguf: bool) -> OffloadForward:
        cfg = OffloadConfig(expert_vram_bytes=0, dtype=torch.float32, prefill_chunk=CHUNK,
                            graphs=False, kernels=INTERPRETED, dense_gguf=gguf)  # fmt: skip
        return OffloadForward(quantized_attention, torch.device("cpu"), cfg)

    plain, gguf = engine(False), engine(True)
    qkv, o, head = gguf.layers[0].qkv, gguf.layers[0].o, gguf.lm_head
    assert isinstance(qkv, GgufMatrix) and isinstance(o, GgufMatrix)
    assert isinstance(head, GgufMatrix)
    assert [q for _, q in qkv.parts] == [QType.Q4_K, QType.Q6_K]  # q and k share a run
    assert isinstance(plain.layers[0].qkv, torch.Tensor) and isinstance(plain.lm_head, torch.Tensor)
    # what the plan subtracts: the dequantized copies' bytes less the blocks the engine holds
    pairs = list(zip(gguf.layers.values(), plain.layers.values(), strict=True))
    held = [(gguf.lm_head, plain.lm_head), *((w.qkv, p.qkv) for w, p in pairs)]
    held += [(w.o, p.o) for w, p in pairs]
    saved = sum(p.numel() * 4 - g.nbytes for g, p in held)  # type: ignore[union-attr]
    n = quantized_attention.spec.n_layers
    assert blocks_saving(quantized_attention, range(n), 4) == saved > 0
    want_tokens, want = greedy_logits(plain, PROMPT, 2)
    tokens, got = greedy_logits(gguf, PROMPT, 2)
    assert tokens == want_tokens
    assert (got - want).norm() / want.norm() < 3e-2 and not torch.equal(got, want)
