"""Test helper: re-export a GGUF with every tensor dequantized to F32.

llama.cpp multiplies quantized weights with activations that it quantizes too (Q8_1), so
its logits on a Q4_1 file differ from exact dequantized arithmetic by ~0.2 on average. On
an F32 copy it computes in float32, which makes a tight, token-for-token comparison fair.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kernels.quant import QType, dequantize
from stratad.model.gguf import open_gguf


def export_f32(src: Path, dst: Path) -> None:
    reader: GGUFReader = open_gguf(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if key == "general.file_type":
            value = 0  # ALL_F32
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    import torch

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = torch.from_numpy(np.array(t.data))
        values = dequantize(raw, QType(t.tensor_type), shape).numpy()
        writer.add_tensor(t.name, values, raw_dtype=QType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
