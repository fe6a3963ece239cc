"""The offload engine's frozen settings (`OffloadForward`'s config)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kernels.formats.quant import QType
from kernels.tuning.configs import KernelConfigs
from stratad.engine.kv import KVPool, resident_split
from stratad.engine.kv_format import PLAIN, KVFormat
from stratad.engine.passes import FUSED_MAX_TOKENS
from stratad.model.spec import ModelSpec
from stratad.store.tiers.slots import SlotSettings


@dataclass(frozen=True)
class OffloadConfig:
    expert_vram_bytes: int  # VRAM for expert slots (the cache)
    max_context: int = 4096
    prefill_chunk: int = 4096
    dtype: torch.dtype = torch.bfloat16
    # capture the decode step as a CUDA graph (a recurrent model's too: Qwen3-Next's states
    # are each cache's own tensors, read through the step's address table)
    graphs: bool = True
    # The most new tokens of one sequence a decode pass takes as rows of their own (a short
    # prompt, a drafted window: `batch.decode_rows`); 1: such tokens go as prefill chunks.
    row_tokens: int = FUSED_MAX_TOKENS
    kv_format: KVFormat = PLAIN  # keys and values as computed, int8 or 4-bit (kv_format)
    # Tokens of each sequence's newest KV kept in VRAM; older blocks go to page-locked RAM,
    # read over PCIe by decode attention (stratad.engine.kv); 0: all in VRAM.
    kv_resident: int = 0
    slots: SlotSettings = SlotSettings()  # how the VRAM slots follow the routing
    # Share of the missed experts of a decode step that the GPU reads in place over PCIe; the
    # rest are computed on the CPU from RAM, in parallel. Below 1 the step synchronises once
    # per layer (the host must see the routing), so it is not captured as a graph.
    pcie_frac: float = 1.0
    # How the GPU gets a decode step's missed experts: "copy" them from RAM into VRAM staging
    # with one fetch kernel per layer (wide loads keep the link busy), then compute from VRAM;
    # or read them "in_place" over PCIe from the fused MoE kernel itself.
    gpu_miss: str = "copy"
    # How the CPU computes its share: the compiled kernels (kernels.cpu.experts) on
    # `cpu_threads` threads (None: every physical core), else torch dequantizing per use.
    cpu_kernels: bool = True
    cpu_threads: int | None = None
    kernels: KernelConfigs = KernelConfigs()  # launch settings (a tuning table's, or defaults)
    # Guess each layer's experts one layer early and copy the misses ahead (see prefetch.py);
    # needs gpu_miss "copy".
    prefetch: bool = False
    # Benchmarks only: each blob a decode step's miss copy moves also waits this long on the
    # GPU (kernels.experts.link_pace), as over a slower link; needs gpu_miss "copy" and no prefetch.
    link_wait_ns_per_blob: int = 0
    # The attention's (and linear attention's) in and out projections and the output head held
    # as their GGUF blocks alone where the int8 dots read their types (`projection.GgufMatrix`):
    # decode dots them in int8, prefill runs GEMMs over slices dequantized as it goes. The
    # tuning table's switch `dense_form` (`gguf`); the plan counts the blocks' bytes.
    dense_gguf: bool = False
    # Q6_K experts held in the split layout (kernels.experts.moe.split_q6_k: aligned words,
    # which the int8 dots alone read) rather than as GGUF blocks: the tuning table's switch
    # `q6_k_layout`; needs the int8 dots for Q6_K in both MoE launches
    q6_k_split: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.pcie_frac <= 1.0:
            raise ValueError(f"pcie_frac {self.pcie_frac} is not in [0, 1]")
        if self.gpu_miss not in GPU_MISS_PATHS:
            raise ValueError(f"gpu_miss {self.gpu_miss!r} is not one of {GPU_MISS_PATHS}")
        if not 1 <= self.row_tokens <= FUSED_MAX_TOKENS:
            raise ValueError(f"row_tokens {self.row_tokens} is not in [1, {FUSED_MAX_TOKENS}]")
        if self.q6_k_split and not self.kernels.moe_int8(QType.Q6_K, split=True):
            raise ValueError("q6_k_split: the split Q6_K layout is read by the int8 dots alone"
                             " (int8_dots in the kernels' moe and moe_down settings)")
        if self.link_wait_ns_per_blob and (self.gpu_miss != "copy" or self.prefetch):
            raise ValueError("a paced link (link_wait_ns_per_blob) paces the miss copy: it needs"
                             " gpu_miss 'copy' and no prefetch")


GPU_MISS_PATHS = ("copy", "in_place")


def pool_spec(spec: ModelSpec) -> ModelSpec:
    """The geometry the offload engine's KV pool holds: for latent attention the latent itself,
    one KV head of the normed latent and the shared rotated key (kv_lora_rank + rope_dim, as
    llama.cpp caches it), its values the same rows, held once (`values_are_keys`; the decode
    kernel reads heads of one width; attention's output past the latent is dropped), else
    the spec's."""
    if spec.mla is None:
        return spec
    return replace(spec, n_kv_heads=1, head_dim=spec.mla.kv_lora_rank + spec.mla.rope_dim,
                   v_head_dim=0)  # fmt: skip


def values_are_keys(spec: ModelSpec) -> bool:
    """Whether the offload engine's pool reads its keys as its values (latent attention's)."""
    return spec.mla is not None


def kv_pool(
    spec: ModelSpec, tokens: int, devices: Sequence[torch.device], config: OffloadConfig
) -> KVPool:
    """The offload engine's KV pool of at least `tokens` rows, layer i on devices[i]: in the
    config's format, and with a resident window its first tier sized for the windows
    (`kv.resident_split`), the rest in page-locked RAM."""
    first, host = resident_split(tokens, config.max_context, config.kv_resident,
                                 config.prefill_chunk)  # fmt: skip
    return KVPool.allocate(pool_spec(spec), first, devices, config.dtype, fmt=config.kv_format,
                           window=config.kv_resident, host_tokens=host,
                           values_are_keys=values_are_keys(spec))  # fmt: skip
