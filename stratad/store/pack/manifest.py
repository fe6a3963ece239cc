"""The pack format: what `manifest.json` says and how one expert blob is laid out.

A pack directory holds `experts.bin` (one blob per (layer, expert), layer-major, each starting
on a 4 KiB boundary so that it can be page-locked, mapped or read with O_DIRECT on its own),
`dense.bin` (every other tensor), `metadata.msgpack` (the source's GGUF metadata or HF config,
for the tokenizer) and `manifest.json`, described here. A blob is the expert's three matrices
back to back (gate, up, down), each in its GGUF block encoding, each starting on a 64-byte
boundary; the layout is the same for every expert of a layer, so a layer's experts are also a
strided stack.

The version is checked before anything else is decoded: a reader never guesses at a format it
does not know.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import msgspec
import torch
from gguf import GGML_QUANT_SIZES

from kernels.formats.quant import FLOAT_QTYPES, QTensor, QType
from stratad.model.spec import ModelSpec
from stratad.model.weights import MLPWeights

FORMAT_VERSION = 1
BLOB_ALIGN = 4096  # a page: blobs can be locked, mapped and read directly one by one
PROJ_ALIGN = 64  # a cache line; also keeps float projections viewable as float tensors

MANIFEST_NAME = "manifest.json"
EXPERTS_NAME = "experts.bin"
DENSE_NAME = "dense.bin"
METADATA_NAME = "metadata.msgpack"

FLOAT_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


class PackError(ValueError):
    """A pack that cannot be read or written; the message names the file (and blob) at fault."""


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def encoded_nbytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` in `qtype`'s encoding (F32/F16/BF16 are 1-value blocks)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    numel = 1
    for d in shape:
        numel *= d
    if shape and shape[-1] % block:
        raise PackError(f"{shape[-1]} columns is not a whole number of {qtype.name} blocks")
    return numel // block * block_bytes


class TensorLayout(msgspec.Struct, frozen=True):
    """Where one tensor's bytes are: `offset` into its file (dense) or into its blob (experts)."""

    qtype: str  # QType name, e.g. "Q4_0", "F32"
    shape: tuple[int, ...]  # logical torch shape (rows..., cols)
    offset: int
    nbytes: int

    @property
    def qt(self) -> QType:
        return QType.__members__[self.qtype]


class ExpertLayout(msgspec.Struct, frozen=True):
    """One expert blob of a layer: its three projections and its size on disk."""

    gate: TensorLayout  # [F, H]
    up: TensorLayout  # [F, H]
    down: TensorLayout  # [H, F]
    nbytes: int  # the blob's bytes (what the checksum covers)
    stride: int  # nbytes rounded up to BLOB_ALIGN: the distance between blobs of a layer

    @property
    def projections(self) -> tuple[TensorLayout, TensorLayout, TensorLayout]:
        return (self.gate, self.up, self.down)


class Blob(msgspec.Struct, frozen=True):
    layer: int
    expert: int
    offset: int  # into experts.bin, a multiple of BLOB_ALIGN
    nbytes: int
    crc32: int


class DenseTensor(msgspec.Struct, frozen=True):
    name: str  # Hugging Face name, as in `Model.tensors`
    tensor: TensorLayout
    # CRC-32 of its bytes, checked at every open (None: a pack written before dense
    # checksums, which is served unchecked)
    crc32: int | None = None


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int
    spec: ModelSpec
    source: str  # the model file (or HF directory) the pack was made from, as an absolute path
    source_format: str  # "gguf" | "hf"
    # its size (a GGUF's bytes, an HF directory's *.safetensors together); 0: not recorded.
    # A damaged blob is re-read from the source when it is still there at this size
    # (`stratad.store.tiers.original`).
    source_nbytes: int = 0
    checksum: str = "crc32"
    experts_nbytes: int  # size of experts.bin
    dense_nbytes: int  # size of dense.bin
    layouts: tuple[ExpertLayout, ...]  # per layer
    blobs: tuple[Blob, ...]  # layer-major: blob (l, e) is blobs[l * n_experts + e]
    dense: tuple[DenseTensor, ...]

    def blob(self, layer: int, expert: int) -> Blob:
        return self.blobs[layer * self.spec.n_experts + expert]


class _Version(msgspec.Struct):
    format_version: int | None = None


def expert_layout(w: MLPWeights) -> ExpertLayout:
    """The blob layout of one expert: gate, up, down back to back."""
    parts, offset = [], 0
    for t in (w.gate, w.up, w.down):
        n = encoded_nbytes(t.qtype, t.shape)
        parts.append(TensorLayout(t.qtype.name, tuple(t.shape), offset, n))
        offset = align(offset + n, PROJ_ALIGN)
    nbytes = parts[-1].offset + parts[-1].nbytes
    return ExpertLayout(parts[0], parts[1], parts[2], nbytes, align(nbytes, BLOB_ALIGN))


def tensor_view(raw: torch.Tensor, t: TensorLayout) -> QTensor:
    """A QTensor onto `raw` (uint8, 1-D, starting where `t.offset` counts from); no copy."""
    qtype = t.qt
    data = raw[t.offset : t.offset + t.nbytes]
    if qtype in FLOAT_QTYPES:
        data = data.view(FLOAT_DTYPES[qtype]).view(t.shape)
    else:
        data = data.view(*t.shape[:-1], t.nbytes // _rows(t.shape))
    return QTensor(data, qtype, t.shape)


def encoded(t: QTensor) -> torch.Tensor:
    """The tensor's encoded bytes (blocks, or the float values) as flat uint8 (CPU)."""
    return t.data.contiguous().reshape(-1).view(torch.uint8)


# gate, up and down of one expert as their encoded bytes (uint8, 1-D)
ExpertBytes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def expert_bytes(raw: torch.Tensor, layout: ExpertLayout) -> ExpertBytes:
    """The three projections' bytes inside blob `raw` (views, no copy)."""
    g, u, d = (raw[t.offset : t.offset + t.nbytes] for t in layout.projections)
    return g, u, d


def blob_view(raw: torch.Tensor, layout: ExpertLayout) -> MLPWeights:
    """The expert held in `raw` (uint8 [>= layout.nbytes]) as MLPWeights of views onto it."""
    return MLPWeights(*(tensor_view(raw, t) for t in layout.projections))


def check_dense(dense: torch.Tensor, manifest: Manifest, where: str) -> list[str]:
    """Each dense tensor's bytes (of the mapped dense.bin, uint8) against its CRC-32: the
    messages of those that fail (empty: intact, or no checksums recorded)."""
    failed = []
    for d in manifest.dense:
        t = d.tensor
        if d.crc32 is None:
            continue
        crc = zlib.crc32(dense[t.offset : t.offset + t.nbytes].numpy().data)
        if crc != d.crc32:
            failed.append(
                f"{where}: tensor {d.name} (offset {t.offset:,}, {t.nbytes:,} bytes) fails its"
                f" checksum (crc32 {crc:08x}, the manifest says {d.crc32:08x}): the pack is"
                " damaged; re-create it with `stratactl pack`"
            )
    return failed


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1)


def check_blobs(manifest: Manifest, experts_nbytes: int, label: str) -> None:
    """Raise `PackError` naming the first blob that experts.bin cannot hold as the manifest
    says: the list must cover each (layer, expert) once, in order, each blob aligned, of its
    layer's size, inside the file (else a read would return bytes that are not its expert)."""
    spec = manifest.spec
    want = spec.n_layers * spec.n_experts
    if len(manifest.blobs) != want:
        raise PackError(
            f"{label}: the manifest lists {len(manifest.blobs)} expert blobs, the model has"
            f" {want} ({spec.n_layers} layers x {spec.n_experts} experts)"
        )
    if len(manifest.layouts) != spec.n_layers:
        raise PackError(f"{label}: {len(manifest.layouts)} blob layouts for {spec.n_layers} layers")
    for i, b in enumerate(manifest.blobs):
        layer, expert = divmod(i, spec.n_experts)
        where = f"{label}: the blob of layer {layer}, expert {expert}"
        if (b.layer, b.expert) != (layer, expert):
            raise PackError(f"{where} is listed as layer {b.layer}, expert {b.expert}")
        if b.offset % BLOB_ALIGN:
            raise PackError(f"{where} starts at {b.offset:,}, not a multiple of {BLOB_ALIGN}")
        if b.nbytes != manifest.layouts[layer].nbytes:
            raise PackError(
                f"{where} has {b.nbytes:,} bytes, its layer's layout"
                f" {manifest.layouts[layer].nbytes:,}"
            )
        if b.offset + b.nbytes > experts_nbytes:
            raise PackError(
                f"{where} ends at byte {b.offset + b.nbytes:,}, past the end of the file"
                f" ({experts_nbytes:,} bytes)"
            )


def read_manifest(pack_dir: Path) -> Manifest:
    """The manifest of a pack directory; an unknown format version is refused by name."""
    path = Path(pack_dir) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PackError(f"{pack_dir}: no {MANIFEST_NAME} (not a Strata pack)") from None
    except OSError as e:
        raise PackError(f"{path}: cannot read: {e.strerror}") from None
    try:
        version = msgspec.json.decode(raw, type=_Version).format_version
    except msgspec.DecodeError as e:
        raise PackError(f"{path}: not a Strata pack manifest: {e}") from None
    if version is None:
        raise PackError(f"{path}: not a Strata pack manifest (no format_version)")
    if version != FORMAT_VERSION:
        newer = "a newer" if version > FORMAT_VERSION else "an older"
        raise PackError(
            f"{path}: pack format version {version} is not supported (this stratad reads"
            f" version {FORMAT_VERSION}); the pack was written by {newer} Strata:"
            " re-create it with `stratactl pack`"
        )
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as e:
        raise PackError(f"{path}: invalid manifest: {e}") from None
