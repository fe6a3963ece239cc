"""The cpu engine's one-call MoE layers over the expert store
(`stratad/engine/reference/store_stack.py`): a CPU-only host's daemon, no VRAM slots, each
expert read where it lies (its pinned RAM copy, else the GGUF's mapping). Held bit for bit to
the same call over the model's own stacks, with the store's counters and the pinning's progress
followed."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
import torch

from kernels.cpu.experts import X8, CpuExperts
from kernels.cpu.moe_stack import MoEStack
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.interleaved_ram import InterleavedExperts, ram_form
from stratad.engine.reference.store_stack import StoreStack
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.store.placement.plan import GiB, Stage
from stratad.store.placement.profile import profile_from_counts, save_profile
from stratad.store.startup import open_store
from stratad.store.store import ExpertStore
from stratad.store.tiers.ram_form import RamForm
from stratad.store.tiers.sources import ModelExperts
from tests.test_store_generation import greedy, three_tiers

PROMPT = list(range(5, 29))
NEW = 8


@pytest.fixture(scope="module")
def model(tiny_moe_model: Model) -> Model:
    return tiny_moe_model  # the session's (tests/conftest.py)


@pytest.fixture(scope="module")
def kernels() -> CpuExperts:
    return CpuExperts(threads=2)


@pytest.fixture(scope="module")
def want(model: Model, kernels: CpuExperts) -> tuple[list[int], torch.Tensor, list[list[int]]]:
    """The one call over the model's own stacks: tokens, logits, routing counts."""
    forward = ReferenceForward(model, weights=QuantWeights(kernels))
    assert isinstance(forward.stack, MoEStack)
    tokens, logits = greedy(forward, PROMPT, NEW)
    return tokens, logits, forward.route_counts.tolist()


def _store(
    model: Model, counts: list[list[int]], tmp_path: Path, ram_form: RamForm | None = None,
    **extra: object,
) -> ExpertStore:  # fmt: skip
    """No VRAM slots; a third of the experts with a RAM copy (in `ram_form`), the rest in the
    file."""
    profile = tmp_path / "profile.json"
    save_profile(profile_from_counts(counts), profile)
    source = ModelExperts(model)
    config = msgspec.structs.replace(three_tiers(source, profile, **extra), expert_cache=0)
    cpu, memory = torch.device("cpu"), (64 * GiB, "MemTotal")
    return open_store(config, source, compute_device=cpu, host_total=memory,
                      read_available=lambda: 64 * GiB, ram_form=ram_form)  # fmt: skip


def test_pinned_and_mapped_experts_in_one_call(
    model: Model, kernels: CpuExperts, want: tuple[list[int], torch.Tensor, list[list[int]]],
    tmp_path: Path,
) -> None:  # fmt: skip
    store = _store(model, want[2], tmp_path)
    fast = ReferenceForward(model, experts=store, weights=QuantWeights(kernels))
    assert isinstance(fast.stack, StoreStack)
    tokens, logits = greedy(fast, PROMPT, NEW)
    assert tokens == want[0]
    assert torch.equal(logits, want[1])
    assert fast.route_counts.tolist() == want[2]
    stats = store.stats()
    assert stats.vram_hits == 0 and stats.ram_hits > 0 and stats.file_hits > 0, stats
    # each step counts each layer's distinct routed experts once, as the per-layer path does
    per_layer = ReferenceForward(model, experts=_store(model, want[2], tmp_path),
                                 weights=QuantWeights(kernels, one_call=False))  # fmt: skip
    greedy(per_layer, PROMPT, NEW)
    other = per_layer.experts.stats()  # type: ignore[union-attr]
    assert (stats.ram_hits, stats.file_hits) == (other.ram_hits, other.file_hits)
    store.close()


def test_the_tables_follow_the_pinning(
    model: Model, kernels: CpuExperts, want: tuple[list[int], torch.Tensor, list[list[int]]],
    tmp_path: Path,
) -> None:  # fmt: skip
    """Served before its RAM copies are pinned (the file's mapping), then from the copies once
    they are, with the same tokens throughout."""
    store = _store(model, want[2], tmp_path, ready_after_pinning=False, pin_rate_gbps=1e-6,
                   pin_chunk_mib=1)  # fmt: skip
    fast = ReferenceForward(model, experts=store, weights=QuantWeights(kernels))
    assert isinstance(fast.stack, StoreStack)
    cache = fast.new_cache(len(PROMPT) + NEW + 1)
    tokens = [int(fast(PROMPT, cache)[-1].argmax())]
    assert store.stats().ram_hits == 0 and store.stats().file_hits > 0
    for i, unit in enumerate(store.ram.units):  # the pinner's work, done here at once
        store.source.read_into(unit.layer, unit.expert, store.ram.slot(i))
        store.ram.mark_ready(i)
    for _ in range(NEW - 1):
        tokens.append(int(fast([tokens[-1]], cache)[-1].argmax()))
    assert tokens == want[0]
    assert store.stats().ram_hits > 0
    store.close()  # stops the pinner in its pacing wait


def test_ram_copies_interleaved_in_one_call(
    model: Model, kernels: CpuExperts, want: tuple[list[int], torch.Tensor, list[list[int]]],
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The cpu engine's RAM copies in rows interleaved in eights (interleaved_ram.py): pinned
    in that layout, read by the one call beside the file's GGUF rows, with the tokens of the
    model's own stacks; the plan sizes the copies as they are made."""
    source = ModelExperts(model)
    weights = QuantWeights(kernels)
    form = ram_form(weights, model, source, (Stage(range(model.spec.n_layers), 0),))
    if not kernels.interleaves:  # a host without AVX2 reads GGUF rows only: copies as in the file
        assert form is None
        return
    assert isinstance(form, InterleavedExperts)
    # no form where another reader needs the file's bytes: VRAM slots, or the per-layer path
    assert ram_form(weights, model, source, (Stage(range(4), 2),)) is None
    per_layer = QuantWeights(kernels, one_call=False)
    assert ram_form(per_layer, model, source, (Stage(range(4), 0),)) is None
    with caplog.at_level(logging.INFO, logger="stratad.store"):
        store = _store(model, want[2], tmp_path, ram_form=form)
    assert "; the copies interleaved in eights" in caplog.text
    layout = source.layouts[0]  # Q4_0 experts: 20 bytes a row and block of 32, not 18
    assert form.stride(0) > layout.stride and store.ram.nbytes == len(store.ram) * form.stride(0)
    fast = ReferenceForward(model, experts=store, weights=weights)
    assert isinstance(fast.stack, StoreStack)
    placed = store.in_place(0)
    assert placed is not None
    in_file = tuple(int(t.qt) for t in layout.projections)
    assert {x.codes for x in placed if x.tier == "ram"} == {tuple(c | X8 for c in in_file)}
    assert {x.codes for x in placed if x.tier == "file"} == {in_file}
    tokens, logits = greedy(fast, PROMPT, NEW)
    assert tokens == want[0]
    # not the same bits: the interleaved dots sum in another order, and a rounding that moves
    # one int8 activation of the next layer moves more (here 0.3% of the mean logit)
    assert torch.equal(logits.argmax(-1), want[1].argmax(-1))
    assert (logits - want[1]).abs().mean() < 0.01 * want[1].abs().mean()
    stats = store.stats()
    assert stats.ram_hits > 0 and stats.file_hits > 0, stats
    with pytest.raises(RuntimeError, match="only in_place"):
        store.get(0, 0)  # a copy in this layout is no GGUF view
    store.close()
