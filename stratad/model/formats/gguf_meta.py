"""Plain-Python views of GGUF metadata (the `gguf` package returns typed field parts)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of a GGUF file as str / int / float / bool / list."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta
