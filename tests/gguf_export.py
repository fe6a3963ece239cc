"""Test helper: re-export a GGUF with its tensors in other types.

`export_f32`: every tensor dequantized to F32. llama.cpp multiplies quantized weights with
activations that it quantizes too (Q8_1), so its logits on a Q4_1 file differ from exact
dequantized arithmetic by ~0.2 on average. On an F32 copy it computes in float32, which makes
a tight, token-for-token comparison fair. `export_retyped`: the tensors a table names
re-quantized to their type (a model mixing types per tensor and per layer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kernels.formats.quant import QType, dequantize, quantize
from stratad.model.formats.gguf import open_gguf


def export_f32(src: Path, dst: Path) -> None:
    _export(src, dst, {}, f32=True)


def export_retyped(src: Path, dst: Path, types: dict[str, QType]) -> None:
    """`src` with each tensor named in `types` re-quantized to its type."""
    _export(src, dst, types, f32=False)


def _export(src: Path, dst: Path, types: dict[str, QType], f32: bool) -> None:
    reader: GGUFReader = open_gguf(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if key == "general.file_type" and f32:
            value = 0  # ALL_F32
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    import torch

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = torch.from_numpy(np.array(t.data))
        qtype = QType(t.tensor_type)
        if f32:
            values = dequantize(raw, qtype, shape).numpy()
            writer.add_tensor(t.name, values, raw_dtype=QType.F32)
        elif types.get(t.name) in (QType.F16, QType.F32):
            values = dequantize(raw, qtype, shape)
            dtype = torch.float16 if types[t.name] == QType.F16 else torch.float32
            writer.add_tensor(t.name, values.to(dtype).numpy(), raw_dtype=types[t.name])
        elif t.name in types:
            blocks = quantize(dequantize(raw, qtype, shape), types[t.name]).numpy()
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=types[t.name])
        else:
            writer.add_tensor(t.name, raw.numpy(), raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
