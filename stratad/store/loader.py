"""One entry point for every model format: a GGUF file, a Hugging Face directory, or a pack
(`stratactl pack`: the store's own layout, which is why this lives with the store)."""

from __future__ import annotations

from pathlib import Path

from stratad.model.spec import Model, ModelError


def load_model(path: Path) -> Model:
    """A GGUF file, a pack (`stratactl pack`) or a Hugging Face directory, by what `path` is."""
    path = Path(path)
    if is_pack(path):
        from stratad.store.pack.packed import load_pack

        return load_pack(path)[0]
    if path.is_dir():
        from stratad.model.formats.hf import load_hf

        return load_hf(path)
    if not path.exists():
        raise ModelError(f"{path}: no such model file or directory")
    from stratad.model.formats.gguf import load_gguf

    return load_gguf(path)


def is_pack(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()
