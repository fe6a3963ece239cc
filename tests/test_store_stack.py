"""The cpu engine's one-call MoE layers over the expert store
(`stratad/engine/reference/store_stack.py`): a CPU-only host's daemon, no VRAM slots, each
expert read where it lies (its pinned RAM copy, else the GGUF's mapping). Held bit for bit to
the same call over the model's own stacks, with the store's counters and the pinning's progress
followed."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from kernels.cpu.experts import CpuExperts
from kernels.cpu.moe_stack import MoEStack
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.store_stack import StoreStack
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.store.placement.plan import GiB
from stratad.store.placement.profile import profile_from_counts, save_profile
from stratad.store.startup import open_store
from stratad.store.store import ExpertStore
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


def _store(model: Model, counts: list[list[int]], tmp_path: Path, **extra: object) -> ExpertStore:
    """No VRAM slots; a third of the experts with a RAM copy, the rest in the file."""
    profile = tmp_path / "profile.json"
    save_profile(profile_from_counts(counts), profile)
    source = ModelExperts(model)
    config = msgspec.structs.replace(three_tiers(source, profile, **extra), expert_cache=0)
    cpu, memory = torch.device("cpu"), (64 * GiB, "MemTotal")
    return open_store(config, source, compute_device=cpu, host_total=memory,
                      read_available=lambda: 64 * GiB)  # fmt: skip


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
