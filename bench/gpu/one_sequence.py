"""One sequence on the offload engine, for the benchmarks that time its steps
(`bench.gpu.verify_cost`, `bench.gpu.spec_oracle`): the model, the engine at an expert budget, a
KV cache of one pool and a random prompt, seeded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stratad.engine.kv import KVCache, pool_tokens
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.offload.kernel_table import configs_for_run
from stratad.model.spec import Model
from stratad.store.loader import load_model


@dataclass
class OneSequence:
    model: Model
    engine: OffloadForward
    cache: KVCache
    prompt: list[int]
    gen: torch.Generator  # seeded: the prompt came from it, drafts may too


def one_sequence(
    path: str, expert_vram_gib: float, context: int, prompt_len: int,
    kernel_table: str | None, device: str = "cuda",
) -> OneSequence:  # fmt: skip
    """The engine (bf16 on a GPU, float32 on a CPU) with `context` tokens of KV for one
    sequence and a random prompt of `prompt_len` tokens (not yet run)."""
    model = load_model(Path(path))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = OffloadConfig(expert_vram_bytes=int(expert_vram_gib * 2**30), max_context=context,
                        prefill_chunk=4096, dtype=dtype,
                        kernels=configs_for_run(kernel_table, model.spec, device))  # fmt: skip
    engine = OffloadForward(model, torch.device(device), cfg)
    cache = KVCache(engine.new_pool(pool_tokens(1, context)), context)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.spec.vocab_size, (prompt_len,), generator=gen).tolist()
    return OneSequence(model, engine, cache, prompt, gen)
