"""Supported architectures: importing this package fills the `ARCHS` table."""

from stratad.model.archs import (
    deepseek2,
    glm4moe,
    gptoss,
    llama,
    mixtral,
    olmoe,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen3next,
)
from stratad.model.archs.base import ARCHS, Arch, arch_for_gguf, arch_for_hf

__all__ = [
    "ARCHS",
    "Arch",
    "arch_for_gguf",
    "arch_for_hf",
    "deepseek2",
    "glm4moe",
    "gptoss",
    "llama",
    "mixtral",
    "olmoe",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "qwen3next",
]
