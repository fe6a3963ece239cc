"""`bench.gpu.e2e --ram-frac`: the RAM tier a daemon would plan when RAM holds a share of the
experts, and the cost its coverage WARNING predicts."""

from __future__ import annotations

import torch

from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig
from stratad.model.spec import Model


def ram_tier(
    model: Model, cfg: OffloadConfig, frac: float
) -> tuple[list[list[int]] | None, dict[str, object]]:
    """Each layer's experts with a RAM copy when RAM holds `frac` of the blobs (None: all),
    placed as the daemon places them, and the cost its coverage WARNING predicts."""
    if frac >= 1.0:
        return None, {}
    from stratad.store.placement.bandwidth import measure_bandwidths
    from stratad.store.placement.coverage import coverage, prompt_cost
    from stratad.store.placement.plan import PlanInputs, place
    from stratad.store.tiers.sources import ModelExperts

    spec, source = model.spec, ModelExperts(model)
    n = spec.n_layers * spec.n_experts
    sizes = tuple(lay.stride for lay in source.layouts for _ in range(spec.n_experts))
    per_layer = cfg.expert_vram_bytes // blob_layouts(model).slot_bytes // spec.n_layers
    slots = min(spec.n_experts, per_layer)
    inputs = PlanInputs(spec.n_layers, spec.n_experts, sizes, (0,) * n,
                        vram_budget=slots * spec.n_layers * max(sizes),
                        ram_budget=int(frac * sum(sizes)))  # fmt: skip
    plan = place(inputs)
    ram = plan.in_ram()
    cov = coverage(plan, inputs.blob_bytes, inputs.counts)
    bw = measure_bandwidths(source, torch.device("cuda"))
    return ram, {
        "ram_frac": frac,
        "covered": cov.covered,
        "experts": cov.total,
        "file_gbs": bw.file_bps / 1e9,
        "predicted_prompt_loss": prompt_cost(cov, bw),
    }
