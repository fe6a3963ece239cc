"""The GPU engine on a tiny model, as the architecture tests build it: 3 of each routed
layer's experts in "VRAM" (on the CPU a second buffer, its Triton kernels interpreted), the
rest read from RAM, float32; and a prompt that takes every path of a pass."""

from __future__ import annotations

from typing import Any

import torch

from kernels.tuning.configs import INTERPRETED, KernelConfigs
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.passes import FUSED_MAX_TOKENS
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model
from tests.greedy import greedy_logits

# a staged chunk (the grouped GEMMs), then 2 tokens (the fused kernels with T > 1), then the
# decode steps a test asks for
PROMPT = list(range(100, 100 + FUSED_MAX_TOKENS + 3))


def tiny_offload(model: Model, device: str, **kw: Any) -> OffloadForward:
    budget = 3 * len(model.spec.moe_layers) * blob_layouts(model).slot_bytes
    kernels = INTERPRETED if device == "cpu" else KernelConfigs()
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, kernels=kernels,
                        prefill_chunk=FUSED_MAX_TOKENS + 1, **kw)  # fmt: skip
    return OffloadForward(model, torch.device(device), cfg)


def assert_as_reference(model: Model, device: str, n: int, tol: float, **kw: Any) -> OffloadForward:
    """The GPU engine's n greedy tokens after PROMPT are the reference engine's, its last
    logits within `tol`; returns the engine (for its counters)."""
    want, want_logits = greedy_logits(ReferenceForward(model), PROMPT, n)
    off = tiny_offload(model, device, **kw)
    got, logits = greedy_logits(off, PROMPT, n)
    assert got == want
    assert (logits.cpu() - want_logits).abs().max() < tol
    return off
