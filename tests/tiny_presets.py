"""Module fixtures for a tiny synth preset: its GGUF written once per test module, and the
model loaded from it (the architecture tests' common start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stratad.model.spec import Model
from stratad.model.synthetic import writer as synth
from stratad.store.loader import load_model


def preset_fixtures(preset: str, path_name: str, model_name: str = "model") -> tuple[Any, Any]:
    """Fixtures `path_name` (the preset's file) and `model_name` (its model), module-scoped;
    assign the pair to module names so that pytest finds them."""

    @pytest.fixture(scope="module", name=path_name)
    def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
        out = tmp_path_factory.mktemp(preset) / f"{preset}.gguf"
        synth.write_synth(synth.PRESETS[preset], out)
        return out

    @pytest.fixture(scope="module", name=model_name)
    def model(request: pytest.FixtureRequest) -> Model:
        return load_model(request.getfixturevalue(path_name))

    return path, model
