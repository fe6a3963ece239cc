"""Writing a pack: a GGUF file or a Hugging Face directory converted, one expert at a time.

Memory stays bounded by one expert blob plus one dense tensor: a GGUF is read through its
mapping and a safetensors file tensor by tensor, so a pack larger than RAM converts. The pack
appears under its name only when complete (written as `DIR.partial`, then renamed).
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch

from kernels.formats.quant import QTensor, QType
from stratad.model.archs import ARCHS, Arch
from stratad.model.spec import ModelSpec
from stratad.model.weights import MLPWeights
from stratad.store.pack.manifest import (
    BLOB_ALIGN,
    DENSE_NAME,
    EXPERTS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    METADATA_NAME,
    PROJ_ALIGN,
    Blob,
    DenseTensor,
    ExpertLayout,
    Manifest,
    PackError,
    TensorLayout,
    align,
    encode_manifest,
    encoded,
    expert_layout,
)

ProgressFn = Callable[[int, int], None]  # (bytes written, total bytes)

# Files of a Hugging Face directory that the tokenizer reads; copied into the pack.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


_HF_QTYPES = {torch.float32: QType.F32, torch.float16: QType.F16, torch.bfloat16: QType.BF16}


class PackSource(Protocol):
    """A model read lazily: its spec, its dense tensors by name, its experts one by one."""

    spec: ModelSpec
    source_format: str
    metadata: dict[str, Any]

    def dense_names(self) -> list[str]: ...

    def dense(self, name: str) -> QTensor: ...

    def expert(self, layer: int, expert: int) -> MLPWeights: ...

    def side_files(self) -> list[Path]: ...


class GGUFPackSource:
    """A GGUF file: every tensor is a view onto its mapping, nothing is read until asked."""

    source_format = "gguf"

    def __init__(self, path: Path) -> None:
        from stratad.model.formats.gguf import load_gguf

        self.model = load_gguf(path)
        self.spec = self.model.spec
        self.metadata = self.model.metadata
        self.arch: type[Arch] = ARCHS[self.spec.arch]
        self._stacked = [
            list(self.arch.hf_expert_names(self.spec, i)) for i in range(self.spec.n_layers)
        ]

    def dense_names(self) -> list[str]:
        experts = {n for names in self._stacked for n in names}
        return [n for n in self.model.tensors if n not in experts]

    def dense(self, name: str) -> QTensor:
        return self.model.tensor(name)

    def expert(self, layer: int, expert: int) -> MLPWeights:
        g, u, d = (self.model.tensor(n)[expert] for n in self._stacked[layer])
        return MLPWeights(g, u, d)

    def side_files(self) -> list[Path]:
        return []


class SafetensorsPackSource:
    """A Hugging Face directory read tensor by tensor through safetensors' lazy handles."""

    source_format = "hf"

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        from stratad.model.archs import arch_for_hf
        from stratad.model.formats.hf import read_config

        self.dir = Path(model_dir)
        self.metadata = read_config(self.dir)
        self.arch = arch_for_hf(self.metadata, str(self.dir))
        self.spec = self.arch.spec_from_hf(self.metadata, str(self.dir))
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise PackError(f"{self.dir}: no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118
        self._templates = [
            list(self.arch.hf_expert_names(self.spec, i).values())
            for i in range(self.spec.n_layers)
        ]
        if self.spec.is_moe and not all(self._templates[i] for i in self.spec.moe_layers):
            # (gpt-oss: each layer's experts fused, or packed as MXFP4, in one tensor)
            raise PackError(f"{self.dir}: a pack of a {self.spec.arch} checkpoint, which stores"
                            " a layer's experts in one tensor, is not written yet: pack its"
                            " GGUF, or serve the directory itself")  # fmt: skip

    def _get(self, name: str) -> QTensor:
        handle = self._where.get(name)
        if handle is None:
            raise PackError(f"{self.dir}: missing tensor {name!r}")
        t = handle.get_tensor(name)
        qtype = _HF_QTYPES.get(t.dtype)
        if qtype is None:
            raise PackError(
                f"{self.dir}: tensor {name!r} has dtype {t.dtype}, expected fp32/fp16/bf16"
            )
        return QTensor(t, qtype, tuple(t.shape))

    def dense_names(self) -> list[str]:
        experts = {
            t.format(e=e)
            for templates in self._templates
            for t in templates
            for e in range(self.spec.n_experts)
        }
        names = [n for n in self._where if n not in experts]
        if self.spec.tie_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        return sorted(names)

    def dense(self, name: str) -> QTensor:
        return self._get(name)

    def expert(self, layer: int, expert: int) -> MLPWeights:
        g, u, d = (self._get(t.format(e=expert)) for t in self._templates[layer])
        return MLPWeights(g, u, d)

    def side_files(self) -> list[Path]:
        return [self.dir / n for n in HF_SIDE_FILES if (self.dir / n).is_file()]


def source_nbytes(path: Path) -> int:
    """The size of a model as a pack records it: a GGUF file's bytes, or an HF directory's
    *.safetensors files together (the files its tensors are read from)."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def open_pack_source(path: Path) -> PackSource:
    path = Path(path)
    if path.is_dir():
        return SafetensorsPackSource(path)
    if not path.is_file():
        raise PackError(f"{path}: no such model file or directory")
    return GGUFPackSource(path)


def _experts(spec: ModelSpec) -> Iterator[tuple[int, int]]:
    for layer in range(spec.n_layers):
        for expert in range(spec.n_experts):
            yield layer, expert


def encode_blob(w: MLPWeights, layout: ExpertLayout, out: memoryview) -> int:
    """Lay one expert out as its blob in `out` (at least `layout.nbytes`, the gaps between
    projections zeroed); returns the CRC-32 of the blob's `nbytes`."""
    end = 0
    for t, place in zip((w.gate, w.up, w.down), layout.projections, strict=True):
        out[end : place.offset] = bytes(place.offset - end)
        out[place.offset : place.offset + place.nbytes] = encoded(t).numpy().data
        end = place.offset + place.nbytes
    return zlib.crc32(out[: layout.nbytes])


def _write_blob(out: Any, w: MLPWeights, layout: ExpertLayout) -> int:
    """Write one expert (padded to its stride with zeros); returns its blob's CRC-32."""
    buf = bytearray(layout.stride)
    crc = encode_blob(w, layout, memoryview(buf))
    out.write(buf)
    return crc


def _check_layout(got: ExpertLayout, want: ExpertLayout, layer: int, expert: int) -> None:
    if got != want:
        raise PackError(
            f"expert {expert} of layer {layer} is stored differently from expert 0"
            f" ({got.projections} vs {want.projections}); a pack needs one layout per layer"
        )


def write_pack(
    src: Path,
    out: Path,
    *,
    overwrite: bool = False,
    on_progress: ProgressFn | None = None,
) -> Manifest:
    """Convert the model at `src` into a pack directory `out`; returns its manifest."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite to replace it")
    source = open_pack_source(src)
    spec = source.spec
    if not spec.is_moe:
        raise PackError(f"{src}: a {spec.arch} model has no routed experts to pack")
    if spec.dense_layers:  # a pack's manifest and readers count every layer's experts
        raise PackError(f"{src}: a pack of a model whose first {spec.dense_layers} layers are"
                        " dense is not written yet: serve the model file itself")  # fmt: skip
    layouts = [expert_layout(source.expert(layer, 0)) for layer in range(spec.n_layers)]
    dense_names = source.dense_names()
    expert_total = sum(lay.stride for lay in layouts) * spec.n_experts
    done, total = 0, expert_total  # dense bytes are added as they are met
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        blobs: list[Blob] = []
        with open(partial / EXPERTS_NAME, "wb") as f:
            for layer, expert in _experts(spec):
                w = source.expert(layer, expert)
                layout = layouts[layer]
                _check_layout(expert_layout(w), layout, layer, expert)
                offset = f.tell()
                crc = _write_blob(f, w, layout)
                blobs.append(Blob(layer, expert, offset, layout.nbytes, crc))
                done += layout.stride
                if on_progress is not None:
                    on_progress(done, total)
            experts_nbytes = f.tell()
        dense: list[DenseTensor] = []
        with open(partial / DENSE_NAME, "wb") as f:
            for name in dense_names:
                t = source.dense(name)
                data = encoded(t).numpy().data
                offset = f.tell()
                f.write(data)
                f.write(bytes(align(offset + len(data), PROJ_ALIGN) - offset - len(data)))
                where = TensorLayout(t.qtype.name, tuple(t.shape), offset, len(data))
                dense.append(DenseTensor(name, where, zlib.crc32(data)))
            # dense.bin is mapped as one tensor; a page-multiple size keeps float views legal
            f.write(bytes(align(f.tell(), BLOB_ALIGN) - f.tell()))
            dense_nbytes = f.tell()
        (partial / METADATA_NAME).write_bytes(msgspec.msgpack.encode(source.metadata))
        for side in source.side_files():
            shutil.copyfile(side, partial / side.name)
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            spec=spec,
            source=os.path.abspath(src),
            source_format=source.source_format,
            source_nbytes=source_nbytes(src),
            experts_nbytes=experts_nbytes,
            dense_nbytes=dense_nbytes,
            layouts=tuple(layouts),
            blobs=tuple(blobs),
            dense=tuple(dense),
        )
        (partial / MANIFEST_NAME).write_bytes(encode_manifest(manifest))
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest
