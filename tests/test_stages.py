"""The layer split: a pipeline of offload engines, here two stages on the CPU (the same code
runs two stages on one GPU, or one per GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.tuning.configs import INTERPRETED
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig
from stratad.engine.offload.stages import StagedForward, balanced_split, parse_split
from stratad.engine.passes import FUSED_MAX_TOKENS
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from tests.greedy import greedy

# a staged chunk (every expert of a layer, grouped GEMMs), then 2 through the fused kernels
CHUNK = FUSED_MAX_TOKENS + 1
PROMPT = list(range(100, 100 + CHUNK + 2))


def test_two_stages_same_tokens_as_one(tiny_moe_model: Model) -> None:
    budget = 3 * tiny_moe_model.spec.n_layers * blob_layouts(tiny_moe_model).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                        kernels=INTERPRETED)
    cpu = torch.device("cpu")
    staged = StagedForward(tiny_moe_model, [cpu, cpu], [0, 1, 4], cfg)
    assert [s.layer_ids for s in staged.stages] == [range(0, 1), range(1, 4)]
    want = greedy(ReferenceForward(tiny_moe_model), PROMPT, 6, 128)
    assert greedy(staged, PROMPT, 6, 128) == want
    # each stage keeps slots and counts for its own layers only
    assert all(not staged.stages[0].experts.slot_of[i] for i in range(1, 4))
    assert staged.stages[1].route_counts[0].sum() == 0 < staged.stages[1].route_counts[1].sum()
    seen = staged.store.lookups
    assert 0 < seen.vram < seen.total


def test_split_parsing_and_balance() -> None:
    assert parse_split("24", 48, 2) == [0, 24, 48]
    assert parse_split("20,28", 48, 2) == [0, 20, 48]
    with pytest.raises(ValueError, match="summing to the model's 48 layers"):
        parse_split("20,20", 48, 2)
    with pytest.raises(ValueError, match="expected layer counts"):
        parse_split("a,b", 48, 2)
    assert balanced_split(48, [20e9, 20e9]) == [0, 24, 48]
    assert balanced_split(48, [10e9, 30e9]) == [0, 12, 48]
    assert balanced_split(3, [1.0, 1000.0]) == [0, 1, 3]  # every stage gets a layer
    assert balanced_split(48, [7e9, 9e9]) == balanced_split(48, [7e9, 9e9])


def test_both_stages_hold_slots_for_their_own_layers_only(tiny_moe_model: Model) -> None:
    """A split where both stages get a non-zero share: each allocates slots for its own
    layers (2 per layer here), never for the other stage's."""
    n = tiny_moe_model.spec.n_layers
    budget = 2 * n * blob_layouts(tiny_moe_model).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, prefill_chunk=CHUNK,
                        kernels=INTERPRETED)
    cpu = torch.device("cpu")
    staged = StagedForward(tiny_moe_model, [cpu, cpu], [0, 2, n], cfg)
    for stage in staged.stages:
        assert stage.experts.n_slots == 2 * len(stage.layer_ids)
        assert [len(stage.experts.slot_of[i]) for i in range(n)] == [
            2 if i in stage.layer_ids else 0 for i in range(n)
        ]
    assert sum(t.n_slots for t in staged.tables) == 2 * n


def test_place_gives_each_stage_the_hottest_of_its_own_layers() -> None:
    from stratad.store.placement.plan import PlanInputs, Stage, place

    counts = (0, 5, 1, 9,  7, 0, 0, 2,  3, 3, 8, 0)  # layers 0, 1, 2 of 4 experts  # fmt: skip
    inputs = PlanInputs(3, 4, (4096,) * 12, counts, vram_budget=5 * 4096, ram_budget=0)
    # stage 0: layer 0 with 2 slots; stage 1: layers 1-2 with 3 slots
    split = place(inputs, [Stage(range(0, 1), 2), Stage(range(1, 3), 3)])
    assert split.residents() == [[1, 3], [0], [0, 2]]
    assert split.bounds == (0, 1, 3)
    # one device ranks every layer together; the split is part of the hash
    whole = place(inputs)
    assert whole.residents() == split.residents() and whole.hash != split.hash
    other = place(inputs, [Stage(range(0, 1), 1), Stage(range(1, 3), 4)])
    assert other.residents() == [[3], [0], [0, 1, 2]]
    # no profile: ties by expert, then layer, within each stage
    flat = replace_counts(inputs, (0,) * 12)
    assert place(flat, [Stage(range(0, 1), 2), Stage(range(1, 3), 3)]).residents() == [
        [0, 1], [0, 1], [0],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="do not cover 3 layers"):
        place(inputs, [Stage(range(0, 1), 2), Stage(range(2, 3), 3)])


def replace_counts(inputs, counts):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(inputs, counts=counts)
