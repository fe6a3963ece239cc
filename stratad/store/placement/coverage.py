"""Coverage: how many experts keep a copy outside the file, and what the others will cost.

Users of the upstream engine lost days to a resident set that landed short, announced by one
INFO line among forty, while long prompts ran 26-30% slower: a long prompt routes through
nearly every expert, so the uncovered ones are read from the file over and over. So: when
coverage is short there is exactly one WARNING that says how many experts will be read from
the file and what that costs, from bandwidths measured on this machine; when it is complete,
one INFO line says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from stratad.store.placement.bandwidth import Bandwidths
from stratad.store.placement.plan import ResidencyPlan
from stratad.store.sizes import size_text

log = logging.getLogger("stratad.store")


@dataclass(frozen=True)
class Coverage:
    per_layer: tuple[tuple[int, int], ...]  # (covered, experts) per layer
    covered: int
    total: int
    mass_share: float | None  # share of the profile's routed mass covered; None: no profile
    file_units: int
    file_bytes: int
    streamed_bytes: int  # bytes of covered experts outside the initial VRAM fill

    @property
    def complete(self) -> bool:
        return self.covered == self.total


def coverage(plan: ResidencyPlan, blob_bytes: Sequence[int], counts: Sequence[int]) -> Coverage:
    """Coverage of `plan`; `blob_bytes` and `counts` are layer-major as in `PlanInputs`."""
    e = plan.n_experts
    covered = plan.covered
    per_layer = []
    for layer in range(plan.n_layers):
        n = sum(1 for u in covered if u.layer == layer)
        per_layer.append((n, e))
    flat = {u.layer * e + u.expert for u in covered}
    vram = {u.layer * e + u.expert for u in plan.vram}
    mass = sum(counts)
    file_idx = [i for i in range(plan.n_total) if i not in flat]
    return Coverage(
        per_layer=tuple(per_layer),
        covered=len(flat),
        total=plan.n_total,
        mass_share=sum(counts[i] for i in flat) / mass if mass else None,
        file_units=len(file_idx),
        file_bytes=sum(blob_bytes[i] for i in file_idx),
        streamed_bytes=sum(blob_bytes[i] for i in flat - vram),
    )


def prompt_cost(cov: Coverage, bw: Bandwidths) -> float:
    """Upper bound of the prompt-speed loss (0..1) on a long prompt that routes every expert.

    Such a prompt streams each expert outside VRAM once per chunk: a covered one at the
    resident copy's bandwidth, an uncovered one at the file's plus the copy's. The loss is the
    extra time over the time with everything covered, as if the prompt were transfer-bound.
    """
    if not cov.file_bytes:
        return 0.0
    if bw.file_bps <= 0 or bw.copy_bps <= 0:
        return 1.0
    base = (cov.streamed_bytes + cov.file_bytes) / bw.copy_bps
    extra = cov.file_bytes / bw.file_bps
    return extra / (base + extra)


def _mass(cov: Coverage) -> str:
    if cov.mass_share is None:
        return "no expert profile, so the routed mass is unknown"
    return f"{100 * cov.mass_share:.1f}% of the routed mass"


def coverage_message(
    cov: Coverage, bw: Bandwidths, plan: ResidencyPlan, label: str
) -> tuple[int, str]:
    """(log level, line) for this coverage: one WARNING when short, one INFO when complete."""
    head = f"coverage: {cov.covered} of {cov.total} experts keep a copy in RAM or VRAM"
    if cov.complete:
        return logging.INFO, f"{head} ({_mass(cov)}); none is read from the file [plan {plan.hash}]"
    short = sorted(
        ((n, total, layer) for layer, (n, total) in enumerate(cov.per_layer) if n < total)
    )[:3]
    layers = ", ".join(f"{layer} ({n}/{total})" for n, total, layer in short)
    return logging.WARNING, (
        f"{head} ({_mass(cov)}); the other {cov.file_units} ({size_text(cov.file_bytes)})"
        f" will be read from {label} when routed. At the measured {bw.file_bps / 1e9:.2f} GB/s"
        f" file read vs {bw.copy_bps / 1e9:.2f} GB/s resident copy, expect up to"
        f" {100 * prompt_cost(cov, bw):.0f}% less prompt speed on long prompts. Least covered"
        f" layers: {layers}. To cover them all, raise store.resident_budget_gib or lower"
        f" store.resident_headroom_gib (STRATA_RESIDENT_HEADROOM_GIB) [plan {plan.hash}]"
    )


def log_coverage(cov: Coverage, bw: Bandwidths, plan: ResidencyPlan, label: str) -> None:
    level, line = coverage_message(cov, bw, plan, label)
    log.log(level, line)
