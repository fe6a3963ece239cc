"""Reading a GGUF file: metadata, spec and tensors as views onto the mapped file."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from kernels.formats.quant import SUPPORTED_QTYPES, QTensor, QType, row_bytes
from stratad.model.archs import arch_for_gguf
from stratad.model.formats.gguf_meta import gguf_metadata
from stratad.model.formats.shapes import check_model
from stratad.model.spec import Model, ModelError


def open_gguf(path: Path) -> GGUFReader:
    """Map a GGUF file, turning the reader's low-level failures into one clear error."""
    if not path.is_file():
        raise ModelError(f"{path}: no such model file")
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        size = path.stat().st_size
        if "cannot reshape array" in str(e):  # the reader maps tensors past the file's end
            raise ModelError(
                f"{path}: truncated: tensor data ends early (the file has {size:,} bytes)"
            ) from None
        raise ModelError(f"{path}: not a readable GGUF file ({size:,} bytes): {e}") from None


def _check_extent(reader: GGUFReader, path: Path) -> None:
    """Every tensor's bytes lie inside the file, on the file's alignment, and apart from every
    other tensor's (a type id or offset that lies would have kernels read past a buffer)."""
    size = path.stat().st_size
    align = int(reader.alignment)
    spans = []
    for t in reader.tensors:
        start, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelError(
                f"{path}: truncated: tensor {t.name!r} needs bytes up to {end:,}"
                f" but the file has {size:,}"
            )
        if (start - int(reader.data_offset)) % align:
            raise ModelError(
                f"{path}: tensor {t.name!r} starts at {start:,}, off the file's {align}-byte"
                " alignment"
            )
        spans.append((start, end, t.name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ModelError(
                f"{path}: tensors {name!r} and {other!r} overlap (bytes {start:,} to {end:,}):"
                " a tensor's type or shape does not match its data"
            )


def _block(name: str) -> int:
    """The block index of a `blk.N.` tensor name; -1 for the others."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1


def _check_layers(reader: GGUFReader, n_layers: int, path: Path) -> None:
    """The block count the metadata states is the blocks the tensors hold."""
    held = {_block(t.name) for t in reader.tensors} - {-1}
    if held != set(range(n_layers)):
        raise ModelError(
            f"{path}: the metadata states {n_layers:,} layers; the tensors hold"
            f" {len(held):,} (blk.{min(held, default=0)} to blk.{max(held, default=-1)})"
        )


def _as_qtensor(t: object, path: Path) -> QTensor:
    qtype = QType(t.tensor_type)  # type: ignore[attr-defined]
    name = t.name  # type: ignore[attr-defined]
    if qtype not in SUPPORTED_QTYPES:
        raise ModelError(
            f"{path}: tensor {name!r} has type {qtype.name}, which Strata does not read"
            f" (supported: {', '.join(sorted(q.name for q in SUPPORTED_QTYPES))})"
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # type: ignore[attr-defined]
    arr = t.data  # type: ignore[attr-defined]
    with warnings.catch_warnings():  # the mapping is read-only; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.asarray(arr))
    if qtype not in (QType.F32, QType.F16, QType.BF16):
        data = data.reshape(*shape[:-1], row_bytes(qtype, shape[-1]))
    elif qtype == QType.BF16:
        data = data.view(torch.bfloat16).reshape(shape)
    else:
        data = data.reshape(shape)
    return QTensor(data, qtype, shape)


def load_gguf(path: Path) -> Model:
    reader = open_gguf(path)
    _check_extent(reader, path)
    meta = gguf_metadata(reader)
    arch = arch_for_gguf(meta, str(path))
    spec = arch.spec_from_gguf(meta, str(path))
    spec = arch.from_tensors(spec, {t.name for t in reader.tensors}, str(path))
    _check_layers(reader, spec.n_layers + arch.gguf_extra_blocks(meta), path)
    names = arch.gguf_names(spec)
    tensors: dict[str, QTensor] = {}
    for t in reader.tensors:
        if _block(t.name) >= spec.n_layers:  # a block the forward does not run (GLM's MTP)
            continue
        hf = names.get(t.name)
        if hf is None:
            raise ModelError(f"{path}: unexpected tensor {t.name!r} for architecture {spec.arch}")
        tensors[hf] = _as_qtensor(t, path)
    if "lm_head.weight" not in tensors:
        spec = replace(spec, tie_embeddings=True)
    model = Model(spec=spec, tensors=tensors, source=path, metadata=meta)
    # fail at load, naming the tensor, not mid-request (or in a kernel)
    check_model(model, [arch.layer(model, i) for i in range(spec.n_layers)])
    model.tensor("model.embed_tokens.weight")
    model.tensor("model.norm.weight")
    return model
