"""Generation through the expert store gives the reference engine's tokens, with experts served
from every tier (VRAM slots on a second CPU "device", resident RAM, the file)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from kernels.cpu.experts import CpuExperts
from stratad.config import StoreConfig
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model
from stratad.store.loader import load_model
from stratad.store.pack.manifest import encoded
from stratad.store.pack.packed import load_pack
from stratad.store.pack.write import write_pack
from stratad.store.placement.bandwidth import Bandwidths
from stratad.store.placement.plan import GiB
from stratad.store.placement.profile import profile_from_counts, save_profile
from stratad.store.startup import open_source, open_store
from stratad.store.store import ExpertStore
from stratad.store.tiers.sources import ExpertSource, ModelExperts, PackExperts
from tests.test_store_fakes import tiny_hf_moe

NEW_TOKENS = 10


def greedy(forward: ReferenceForward, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after `prompt`, and the logits of every step [n, V]."""
    cache = forward.new_cache(len(prompt) + n)
    logits = forward(prompt, cache)[-1]
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = forward([tokens[-1]], cache)[-1]
    return tokens, torch.stack(seen)


class Reference:
    def __init__(self, model: Model, prompt: list[int]) -> None:
        self.model = model
        self.prompt = prompt
        forward = ReferenceForward(model)
        self.tokens, self.logits = greedy(forward, prompt, NEW_TOKENS)
        self.counts = forward.route_counts.tolist()


@pytest.fixture(scope="module")
def gguf_ref(tiny_moe_model: Model) -> Reference:
    model = tiny_moe_model
    prompt = torch.randint(
        0, model.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(3)
    )
    return Reference(model, prompt.tolist())


@pytest.fixture(scope="module")
def hf_ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    model = load_model(tiny_hf_moe(tmp_path_factory))
    prompt = torch.randint(
        0, model.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(3)
    )
    return Reference(model, prompt.tolist())


def three_tiers(source: ExpertSource, profile: Path, **extra: object) -> StoreConfig:
    """A quarter of the experts start in VRAM, a third more keep a RAM copy, the rest stay in
    the file."""
    stride = source.layouts[0].stride
    n = source.n_layers * source.n_experts
    return msgspec.convert(
        {
            "expert_cache": n // 4,
            "resident_budget_gib": (n // 3) * stride / GiB,
            "expert_profile": str(profile),
            "lock": "auto",  # mlock on this CPU machine: a few hundred KiB, inside RLIMIT_MEMLOCK
            "pin_rate_gbps": 0,
            "ready_after_pinning": True,
            **extra,
        },
        type=StoreConfig,
    )


def run_through_store(
    ref: Reference, model: Model, source: ExpertSource, config: StoreConfig, **kw: object
) -> ExpertStore:
    store = open_store(
        config,
        source,
        compute_device=torch.device("cpu"),
        cache_device=torch.device("cpu"),  # the VRAM tier's logic, on a second CPU "device"
        host_total=(64 * GiB, "MemTotal"),
        read_available=lambda: 64 * GiB,
        **kw,  # type: ignore[arg-type]
    )
    tokens, logits = greedy(ReferenceForward(model, experts=store), ref.prompt, NEW_TOKENS)
    assert tokens == ref.tokens
    assert torch.equal(logits, ref.logits)  # bit for bit: the same blocks, dequantized alike
    return store


def _profile(ref: Reference, tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    save_profile(profile_from_counts(ref.counts), path)
    return path


def _assert_every_tier_served(store: ExpertStore) -> None:
    stats = store.stats()
    plan = store.plan
    assert plan.vram and plan.ram and plan.file_only
    assert stats.vram_hits > 0 and stats.ram_hits > 0 and stats.file_hits > 0, stats
    assert stats.pinned_bytes == stats.planned_ram_bytes == plan.ram_bytes
    assert stats.plan_hash == plan.hash


def test_gguf_in_place(gguf_ref: Reference, tmp_path: Path) -> None:
    source = ModelExperts(gguf_ref.model)
    config = three_tiers(source, _profile(gguf_ref, tmp_path))
    store = run_through_store(gguf_ref, gguf_ref.model, source, config)
    _assert_every_tier_served(store)
    assert store.pinner.locker.name == "mlock"
    store.close()


def test_pack_without_admission_into_vram(gguf_ref: Reference, tmp_path: Path) -> None:
    """From a pack: dense weights mapped from dense.bin, experts pread (and verified) from
    experts.bin. Without admission the VRAM slots keep the plan's experts, so the file tier
    keeps serving its share."""
    pack = tmp_path / "tiny.pack"
    write_pack(gguf_ref.model.source, pack)
    model, _ = load_pack(pack)
    source = open_source(StoreConfig(pack=str(pack)), model)
    assert isinstance(source, PackExperts)
    config = three_tiers(source, _profile(gguf_ref, tmp_path), admit_on_miss=False)
    store = run_through_store(gguf_ref, model, source, config, bandwidths=Bandwidths(1e9, 1e10))
    _assert_every_tier_served(store)
    stats = store.stats()
    assert stats.evictions == 0
    assert stats.file_reads >= stats.file_hits + len(store.plan.vram) + len(store.plan.ram)
    store.close()


def test_full_coverage_float_experts_and_lru(hf_ref: Reference, tmp_path: Path) -> None:
    """With every expert in RAM, every VRAM slot adapts (its expert has a RAM copy to fall
    back on) and nothing is read from the file after the start."""
    source = ModelExperts(hf_ref.model)
    n = source.n_layers * source.n_experts
    config = three_tiers(
        source,
        _profile(hf_ref, tmp_path),
        cache_policy="lru",
        resident_budget_gib=n * source.layouts[0].stride / GiB,
    )
    store = run_through_store(hf_ref, hf_ref.model, source, config)
    stats = store.stats()
    assert not store.plan.file_only and not store.cache.keep
    assert stats.vram_hits > 0 and stats.ram_hits > 0 and stats.file_hits == 0, stats
    assert stats.evictions > 0
    store.close()


def test_experts_not_yet_pinned_come_from_the_file(gguf_ref: Reference, tmp_path: Path) -> None:
    """Ready before pinning, and pinning so slow that it has barely begun: the RAM tier's
    experts are served from the file meanwhile, with the same tokens."""
    source = ModelExperts(gguf_ref.model)
    config = three_tiers(
        source,
        _profile(gguf_ref, tmp_path),
        ready_after_pinning=False,
        pin_rate_gbps=1e-6,
        pin_chunk_mib=1,
    )
    store = run_through_store(
        gguf_ref, gguf_ref.model, source, config, bandwidths=Bandwidths(1e9, 1e10)
    )
    stats = store.stats()
    assert stats.pinned_bytes == 0 and stats.planned_ram_bytes > 0
    assert stats.ram_hits == 0 and stats.vram_hits > 0 and stats.file_hits > 0
    store.close()  # stops the pinner in its pacing wait


@pytest.fixture(scope="module")
def cpu_kernels() -> CpuExperts:
    return CpuExperts(threads=2)


@pytest.mark.parametrize("case", ["gguf-three-tiers-mapped", "hf-float-experts-adapting"])
def test_cpu_engine_reads_a_steps_experts_from_the_tiers_in_one_call(
    case: str, request: pytest.FixtureRequest, cpu_kernels: CpuExperts, tmp_path: Path
) -> None:
    """The cpu engine over the store (a CPU-only host's daemon): each layer's experts of a
    step fetched together from the tiers and computed in one kernel call. Its tokens and
    logits are the cpu engine's from the model's own stacks, bit for bit: from all three
    tiers with the file tier the GGUF's mapping (no admission: nothing to copy into a slot),
    and with every slot adapting (float blobs, LRU, evictions), where a slot that a step
    reads must not be refilled under it."""
    ref: Reference = request.getfixturevalue("gguf_ref" if case.startswith("gguf") else "hf_ref")
    model = ref.model
    source = ModelExperts(model)
    n = source.n_layers * source.n_experts
    config = three_tiers(source, _profile(ref, tmp_path), admit_on_miss=case.startswith("hf"))
    if case.startswith("hf"):
        budget = n * source.layouts[0].stride / GiB
        config = msgspec.structs.replace(config, cache_policy="lru", resident_budget_gib=budget)
    store = open_store(config, source, compute_device=torch.device("cpu"),
                       cache_device=torch.device("cpu"), host_total=(64 * GiB, "MemTotal"),
                       read_available=lambda: 64 * GiB)  # fmt: skip
    fast = ReferenceForward(model, experts=store, weights=QuantWeights(cpu_kernels))
    assert fast.store_experts is not None
    assert all(fast.store_experts.reads(i) for i in range(model.spec.n_layers))
    # these stores must fetch (slots to admit into), so the engine goes layer by layer: held
    # to the same path over the model's own stacks (the stacks' one call keeps a half cache)
    assert fast.stack is None
    stacks = ReferenceForward(model, weights=QuantWeights(cpu_kernels, one_call=False))
    tokens, logits = greedy(fast, ref.prompt, NEW_TOKENS)
    want_tokens, want_logits = greedy(stacks, ref.prompt, NEW_TOKENS)
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
    assert torch.equal(fast.route_counts, stacks.route_counts)
    stats = store.stats()
    if case.startswith("gguf"):
        _assert_every_tier_served(store)
        got: list[list[torch.Tensor]] = []
        store.use_experts(0, range(source.n_experts), lambda parts: got.extend(map(list, parts)))
        for e, parts in enumerate(got):  # every tier's bytes are the expert's own
            w = store.get(0, e)
            want = (encoded(w.gate), encoded(w.up), encoded(w.down))
            assert all(torch.equal(p, t) for p, t in zip(parts, want, strict=True))
    else:
        assert stats.vram_hits > 0 and stats.ram_hits > 0 and stats.evictions > 0, stats
    store.close()
