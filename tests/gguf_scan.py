"""Test helper: a quick walk over a GGUF file's header, and its tensors' bytes.

gguf-py's GGUFReader turns every vocabulary string into numpy views: 3-4 s for the 49k-token
vocabulary the synthetic models carry. Walking the header with `struct` (GGUF v3: magic,
version, counts, key-value pairs, tensor infos, then the aligned data) takes a tenth of that,
which matters for tests that read ten files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

# GGUF value types with a fixed size: struct format by type id.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ScannedTensor:
    name: str
    qtype: QType
    shape: tuple[int, ...]  # torch order: GGUF's dimensions reversed
    offset: int  # in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return self.buf[self.at - n : self.at].decode()

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        assert vtype == _ARRAY, vtype
        item, count = self.take("I"), self.take("Q")
        if item in _SCALARS:  # skipped: no test reads a numeric array
            self.at += count * struct.calcsize(_SCALARS[item])
            return None
        return [self.value(item) for _ in range(count)]


def scan(path: Path) -> tuple[dict[str, Any], list[ScannedTensor]]:
    """(scalar and string metadata, tensors in file order) of a GGUF v3 file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(min(size, 64 << 20))  # the header of a model with a large vocabulary
    c = _Cursor(head)
    assert head[:4] == b"GGUF" and c.take("4s") and c.take("I") == 3
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("Q") for _ in range(c.take("I"))]
        infos.append((name, QType(c.take("I")), tuple(reversed(dims)), c.take("Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-c.at // align) * align
    tensors = []
    for name, qtype, shape, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        tensors.append(ScannedTensor(name, qtype, shape, start + offset, nbytes))
    return meta, tensors


def tensor_bytes(path: Path, t: ScannedTensor) -> np.ndarray:
    """The tensor's raw bytes, uint8 [nbytes], mapped from the file."""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
