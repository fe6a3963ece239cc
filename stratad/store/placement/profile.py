"""The expert profile: how often each (layer, expert) was routed to, saved and loaded.

The engine counts routes (`ReferenceForward.route_counts`); the plan places the hottest
experts in the fastest tiers. A profile is a small JSON file (`store.expert_profile`,
`--expert-profile FILE`), so that a restart plans from yesterday's traffic.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file."""


class ExpertProfile(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int = PROFILE_VERSION
    n_layers: int
    n_experts: int
    counts: tuple[tuple[int, ...], ...]  # [layer][expert]

    @property
    def flat(self) -> tuple[int, ...]:
        """Layer-major counts, as `PlanInputs.counts` takes them."""
        return tuple(c for row in self.counts for c in row)

    @property
    def total(self) -> int:
        return sum(self.flat)


def uniform_profile(n_layers: int, n_experts: int) -> ExpertProfile:
    """No knowledge: every expert alike."""
    return ExpertProfile(
        n_layers=n_layers, n_experts=n_experts, counts=((0,) * n_experts,) * n_layers
    )


def profile_from_counts(counts: Sequence[Sequence[int]]) -> ExpertProfile:
    """From a [layers][experts] table of counts (e.g. `route_counts.tolist()`)."""
    rows = tuple(tuple(int(c) for c in row) for row in counts)
    if not rows or len({len(r) for r in rows}) != 1:
        raise ProfileError("routing counts must be a non-empty [layers][experts] table")
    if any(c < 0 for row in rows for c in row):
        raise ProfileError("routing counts cannot be negative")
    return ExpertProfile(n_layers=len(rows), n_experts=len(rows[0]), counts=rows)


def merge(a: ExpertProfile, b: ExpertProfile) -> ExpertProfile:
    """Counts of both (same geometry): a saved profile plus what this run routed."""
    if (a.n_layers, a.n_experts) != (b.n_layers, b.n_experts):
        raise ProfileError(
            f"profiles of {a.n_layers}x{a.n_experts} and {b.n_layers}x{b.n_experts} experts"
        )
    rows = zip(a.counts, b.counts, strict=True)
    return profile_from_counts([[x + y for x, y in zip(ra, rb, strict=True)] for ra, rb in rows])


def save_profile(profile: ExpertProfile, path: Path) -> None:
    """Write atomically (a reader never sees half a file), through a temporary file created
    new beside it (exclusively: a link placed where it would go is never followed out)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # as a plain write would leave it (mkstemp: 0600)
            f.write(msgspec.json.encode(profile))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # nothing half-written is left behind
        raise


def load_profile(path: Path, n_layers: int, n_experts: int) -> ExpertProfile:
    """A saved profile, checked against the model's geometry."""
    path = Path(path)
    try:
        profile = msgspec.json.decode(path.read_bytes(), type=ExpertProfile)
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the expert profile: {e.strerror}") from None
    except msgspec.DecodeError as e:
        raise ProfileError(f"{path}: not an expert profile: {e}") from None
    if profile.format_version != PROFILE_VERSION:
        raise ProfileError(
            f"{path}: expert profile version {profile.format_version} is not supported"
            f" (this stratad reads version {PROFILE_VERSION})"
        )
    shape = (len(profile.counts), *{len(r) for r in profile.counts})
    if (profile.n_layers, profile.n_experts) != (n_layers, n_experts) or shape != (
        n_layers,
        n_experts,
    ):
        raise ProfileError(
            f"{path}: the profile is for {profile.n_layers} layers x {profile.n_experts} experts,"
            f" the model has {n_layers} x {n_experts}"
        )
    return profile
