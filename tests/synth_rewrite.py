"""A synth preset's GGUF written again with other metadata or tensors: the tests' way to make
a variant of a synthetic file (its F32 copy, a RoPE scaling it states, an extra block)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from stratad.model.synthetic import writer as synth
from stratad.model.synthetic.presets import SynthPreset


def rewrite(
    preset: SynthPreset,
    dst: Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    edit: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """`dst`: the preset's metadata (then `edit`'s keys; a key given again keeps the last
    value) and `tensors` (name, values) in that order."""
    w = GGUFWriter(dst, preset.arch)
    synth._add_metadata(w, preset, 0, synth.tokenizer_source())
    if edit is not None:
        edit(w)
    for name, values in tensors:
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
