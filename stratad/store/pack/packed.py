"""Opening a pack as a `Model`: dense tensors and expert stacks as views onto the mapped files.

The engine reads routed experts through the `ExpertStore`, not through these stacks; they
exist so that a pack is a complete model (the reference engine and tests can use it as is),
and they cost nothing until touched.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import msgspec
import numpy as np
import torch

from kernels.formats.quant import FLOAT_QTYPES, QTensor
from stratad.model.archs import ARCHS
from stratad.model.spec import Model
from stratad.store.pack.manifest import (
    DENSE_NAME,
    EXPERTS_NAME,
    FLOAT_DTYPES,
    MANIFEST_NAME,
    METADATA_NAME,
    Manifest,
    PackError,
    check_blobs,
    check_dense,
    read_manifest,
    tensor_view,
)


def map_file(path: Path, nbytes: int) -> torch.Tensor:
    """A read-only mapping of a file as uint8 [nbytes]; refuses a file of the wrong size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PackError(f"{path}: missing from the pack") from None
    if size != nbytes:
        raise PackError(
            f"{path}: {size:,} bytes, the manifest says {nbytes:,} (truncated or replaced?)"
        )
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    array = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():  # read-only mapping; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _expert_stacks(manifest: Manifest, experts: torch.Tensor) -> dict[str, QTensor]:
    """Per layer, `...experts.{gate,up,down}_proj` [E, rows, cols] as strided views."""
    spec = manifest.spec
    arch = ARCHS[spec.arch]
    out: dict[str, QTensor] = {}
    for layer, layout in enumerate(manifest.layouts):
        first = manifest.blob(layer, 0)
        for e in range(spec.n_experts):
            if manifest.blob(layer, e).offset != first.offset + e * layout.stride:
                raise PackError(f"{EXPERTS_NAME}: blobs of layer {layer} are not evenly strided")
        for name, t in zip(arch.hf_expert_names(spec, layer), layout.projections, strict=True):
            qtype, start = t.qt, first.offset + t.offset
            if qtype in FLOAT_QTYPES:
                base, unit = experts.view(FLOAT_DTYPES[qtype]), FLOAT_DTYPES[qtype].itemsize
                rows, cols = t.shape
            else:
                base, unit = experts, 1
                rows, cols = t.shape[0], t.nbytes // t.shape[0]
            data = base.as_strided(
                (spec.n_experts, rows, cols), (layout.stride // unit, cols, 1), start // unit
            )
            out[name] = QTensor(data, qtype, (spec.n_experts, *t.shape))
    return out


def load_pack(pack_dir: Path) -> tuple[Model, Manifest]:
    """The model a pack holds, and its manifest."""
    pack_dir = Path(pack_dir)
    manifest = read_manifest(pack_dir)
    dense = map_file(pack_dir / DENSE_NAME, manifest.dense_nbytes)
    experts = map_file(pack_dir / EXPERTS_NAME, manifest.experts_nbytes)
    check_blobs(manifest, manifest.experts_nbytes, str(pack_dir / EXPERTS_NAME))
    # the dense weights are read whole at start anyway: a flipped byte is refused, not served
    damaged = check_dense(dense, manifest, str(pack_dir / DENSE_NAME))
    if damaged:
        raise PackError(damaged[0])
    tensors = {d.name: tensor_view(dense, d.tensor) for d in manifest.dense}
    tensors |= _expert_stacks(manifest, experts)
    try:
        metadata = msgspec.msgpack.decode((pack_dir / METADATA_NAME).read_bytes())
    except (OSError, msgspec.DecodeError) as e:
        raise PackError(f"{pack_dir / METADATA_NAME}: cannot read: {e}") from None
    # A GGUF-made pack names a file as its source, so that the tokenizer comes from the
    # metadata; an HF-made pack names the directory, which holds the tokenizer files.
    source = pack_dir if manifest.source_format == "hf" else pack_dir / MANIFEST_NAME
    model = Model(spec=manifest.spec, tensors=tensors, source=source, metadata=metadata)
    arch = ARCHS[manifest.spec.arch]
    for i in range(manifest.spec.n_layers):
        arch.layer(model, i)
    return model, manifest
