"""The residency plan (property tests), the RAM budget, the expert profile and the cache policy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratad.model.spec import ExpertUnit
from stratad.store.placement.plan import GiB, PlanInputs, place, ram_budget
from stratad.store.placement.profile import (
    ProfileError,
    load_profile,
    merge,
    profile_from_counts,
    save_profile,
)
from stratad.store.tiers.cache import ExpertCache

PAGE = 4096
RANK = {"vram": 0, "ram": 1, "file": 2}


@st.composite
def plan_inputs(draw: st.DrawFn) -> PlanInputs:
    n_layers = draw(st.integers(1, 5))
    n_experts = draw(st.integers(1, 12))
    n = n_layers * n_experts
    # Real packs have one size per layer (mixed quant types differ between layers).
    per_layer = draw(st.lists(st.integers(1, 6), min_size=n_layers, max_size=n_layers))
    sizes = tuple(per_layer[i // n_experts] * PAGE for i in range(n))
    counts = tuple(draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)))
    total = sum(sizes)
    return PlanInputs(
        n_layers=n_layers,
        n_experts=n_experts,
        blob_bytes=sizes,
        counts=counts,
        vram_budget=draw(st.integers(0, total)),
        ram_budget=draw(st.integers(0, total + PAGE)),
    )


@settings(max_examples=150, deadline=None, database=None)
@given(plan_inputs())
def test_same_inputs_same_plan(inputs: PlanInputs) -> None:
    a = place(inputs)
    b = place(PlanInputs(**{**inputs.__dict__}))
    assert a == b and a.hash == b.hash and len(a.hash) == 12


@settings(max_examples=150, deadline=None, database=None)
@given(plan_inputs())
def test_budgets_hold_and_tiers_partition(inputs: PlanInputs) -> None:
    plan = place(inputs)
    size = {
        ExpertUnit(i // inputs.n_experts, i % inputs.n_experts): s
        for i, s in enumerate(inputs.blob_bytes)
    }
    assert plan.ram_bytes == sum(size[u] for u in plan.ram) <= inputs.ram_budget
    assert plan.vram_bytes <= inputs.vram_budget
    assert len(set(plan.vram)) == len(plan.vram) and len(set(plan.ram)) == len(plan.ram)
    assert plan.covered | set(plan.file_only) == set(size)
    assert not plan.covered & set(plan.file_only)


@settings(max_examples=150, deadline=None, database=None)
@given(plan_inputs(), st.data())
def test_monotone_in_both_budgets(inputs: PlanInputs, data: st.DataObject) -> None:
    plan = place(inputs)
    more_ram = place(
        replace(inputs, ram_budget=inputs.ram_budget + data.draw(st.integers(0, 8 * PAGE)))
    )
    assert set(plan.ram) <= set(more_ram.ram) and plan.vram == more_ram.vram
    more_vram = place(
        replace(inputs, vram_budget=inputs.vram_budget + data.draw(st.integers(0, 8 * PAGE)))
    )
    assert set(plan.vram) <= set(more_vram.vram)
    assert plan.covered <= more_vram.covered


@settings(max_examples=150, deadline=None, database=None)
@given(plan_inputs())
def test_hotter_experts_sit_in_faster_tiers(inputs: PlanInputs) -> None:
    plan = place(inputs)
    e = inputs.n_experts
    rank = {
        u: RANK[plan.tier(u)]
        for u in (ExpertUnit(i // e, i % e) for i in range(len(inputs.counts)))
    }
    count = {ExpertUnit(i // e, i % e): c for i, c in enumerate(inputs.counts)}
    for a in rank:
        for b in rank:
            if count[a] > count[b]:
                assert rank[a] <= rank[b], (a, b, plan)


def test_ram_copies_of_vram_experts_only_where_they_can_be_evicted() -> None:
    """A VRAM expert's RAM copy is where it goes when evicted: with one expert outside VRAM
    the others have theirs (after the outsider's); with every expert in VRAM nothing misses
    or is evicted, and RAM holds nothing to pin."""
    n = 2 * 3
    inputs = PlanInputs(n_layers=2, n_experts=3, blob_bytes=(PAGE,) * n,
                        counts=tuple(range(n, 0, -1)), vram_budget=(n - 1) * PAGE,
                        ram_budget=n * PAGE)  # fmt: skip
    short = place(inputs)
    assert len(short.vram) == n - 1 and len(short.ram) == n
    assert short.ram[0] not in short.vram_set and not short.vram_only
    full = place(replace(inputs, vram_budget=n * PAGE))
    assert len(full.vram) == n and full.ram == () and full.ram_bytes == 0
    assert full.vram_only == full.vram_set and not full.file_only


def test_plan_hash_is_stable_across_processes() -> None:
    """A golden value: the log and the control socket show it, operators compare it."""
    inputs = PlanInputs(
        n_layers=2,
        n_experts=4,
        blob_bytes=(PAGE,) * 8,
        counts=(5, 1, 0, 3, 2, 2, 9, 0),
        vram_budget=2 * PAGE,
        ram_budget=4 * PAGE,
    )
    plan = place(inputs)
    assert plan.vram == (ExpertUnit(1, 2), ExpertUnit(0, 0))
    assert plan.ram == (ExpertUnit(0, 3), ExpertUnit(1, 0), ExpertUnit(1, 1), ExpertUnit(0, 1))
    assert plan.file_only == (ExpertUnit(0, 2), ExpertUnit(1, 3))
    assert plan.hash == "3bb41a4651bb"


def test_ram_budget_auto_and_configured() -> None:
    reserves = [
        ("resident_headroom_gib", 4 * GiB),
        ("reserve_runtime_gib", 2 * GiB),
        ("dense weights", GiB // 2),
    ]
    auto = ram_budget(None, 50 * GiB, reserves)
    assert auto.bytes == int(43.5 * GiB)
    assert auto.describe() == (
        "resident budget 43.50 GiB = MemTotal 50.00 - resident_headroom_gib 4.00"
        " - reserve_runtime_gib 2.00 - dense weights 0.50 GiB"
    )
    assert ram_budget(None, 4 * GiB, reserves).bytes == 0  # never negative
    fixed = ram_budget(33.25, 50 * GiB, reserves)
    assert fixed.bytes == int(33.25 * GiB)
    assert fixed.describe() == "resident budget 33.25 GiB (store.resident_budget_gib)"


# --- the expert profile -------------------------------------------------------------------


def test_profile_round_trip_and_geometry(tmp_path: Path) -> None:
    p = profile_from_counts([[3, 0, 1], [0, 7, 2]])
    path = tmp_path / "profile.json"
    save_profile(p, path)
    loaded = load_profile(path, 2, 3)
    assert loaded == p and loaded.flat == (3, 0, 1, 0, 7, 2)
    assert merge(p, p).counts == ((6, 0, 2), (0, 14, 4))
    with pytest.raises(
        ProfileError, match=r"profile is for 2 layers x 3 experts, the model has 48 x 128"
    ):
        load_profile(path, 48, 128)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="bad.json: not an expert profile"):
        load_profile(tmp_path / "bad.json", 2, 3)


# --- the VRAM cache -----------------------------------------------------------------------


def _u(layer: int, expert: int) -> ExpertUnit:
    return ExpertUnit(layer, expert)


def test_initial_fill_is_the_plans_and_kept_experts_stay() -> None:
    initial = [_u(0, 0), _u(0, 1), _u(1, 0)]
    cache = ExpertCache(3, "lru", initial=initial, keep=[_u(0, 0)])
    assert [cache.lookup(u) for u in initial] == [0, 1, 2]
    for e in range(2, 8):  # a stream of new experts never evicts the kept one
        slot, evicted = cache.admit(_u(2, e))
        assert slot is not None and evicted != _u(0, 0)
    assert cache.lookup(_u(0, 0)) == 0


def test_lru_evicts_least_recent() -> None:
    cache = ExpertCache(2, "lru")
    cache.admit(_u(0, 0))
    cache.admit(_u(0, 1))
    cache.lookup(_u(0, 0))
    assert cache.admit(_u(0, 2)) == (1, _u(0, 1))


def test_lfru_protects_reused_experts_from_a_scan() -> None:
    cache = ExpertCache(4, "lfru")
    for e in (0, 1):
        cache.admit(_u(0, e))
        cache.lookup(_u(0, e))  # used twice: protected
    for e in range(10, 30):  # a long prompt's one-off experts
        cache.admit(_u(0, e))
    assert cache.lookup(_u(0, 0)) is not None and cache.lookup(_u(0, 1)) is not None
    lru = ExpertCache(4, "lru")
    for e in (0, 1):
        lru.admit(_u(0, e))
        lru.lookup(_u(0, e))
    for e in range(10, 30):
        lru.admit(_u(0, e))
    assert lru.lookup(_u(0, 0)) is None  # plain LRU lets the scan flush them


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        ExpertCache(2, "mru")


def test_profile_save_writes_only_beside_the_configured_profile(tmp_path: Path) -> None:
    from stratad.control.provider import Unavailable
    from stratad.control.store_view import profile_target

    home = tmp_path / "profiles"
    home.mkdir()
    configured = str(home / "a3b.json")
    assert profile_target("", configured) == home / "a3b.json"
    assert profile_target("other.json", configured) == home / "other.json"
    assert profile_target(str(home / "x.json"), configured) == home / "x.json"
    for bad in ("/etc/cron.d/evil", "../evil.json", str(tmp_path / "evil.json"), ".."):
        with pytest.raises(Unavailable, match="writes only in"):
            profile_target(bad, configured)
    (home / "link").symlink_to(tmp_path)  # a symlinked directory out of it is refused too
    with pytest.raises(Unavailable, match="writes only in"):
        profile_target("link/evil.json", configured)
    with pytest.raises(Unavailable, match="store.expert_profile is not set"):
        profile_target("p.json", "")
    with pytest.raises(Unavailable, match="NUL"):  # was a traceback
        profile_target("p\0.json", configured)


def test_a_failed_profile_save_leaves_no_tmp(tmp_path: Path) -> None:
    target = tmp_path / "p.json"
    target.mkdir()  # os.replace onto a directory fails
    with pytest.raises(OSError):
        save_profile(profile_from_counts([[1, 2], [3, 4]]), target)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_profile_save_follows_no_link_placed_at_its_temporary(tmp_path: Path) -> None:
    """A link where the old temporary file went (NAME.json.tmp) pointing out of the
    directory: the save writes its own new file, the link's target is untouched."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    home = tmp_path / "profiles"
    home.mkdir()
    (home / "p.json.tmp").symlink_to(outside)
    save_profile(profile_from_counts([[1, 2], [3, 4]]), home / "p.json")
    assert outside.read_text() == "keep"
    assert (home / "p.json").is_file() and not (home / "p.json").is_symlink()
