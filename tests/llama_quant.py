"""llama.cpp's own choice of tensor types, as a test oracle: a dry-run `llama_model_quantize`.

The source file holds a synthetic preset's tensors as llama.cpp's converter writes them (F16
weights, F32 norms and router) with no data behind them: its tail is a hole (a sparse file),
and a dry run reads only the tensor infos (llama-quant.cpp skips `load_data_for` under
`dry_run`), so even a3b's 60 GB source costs a few MB. The type chosen for each tensor is
read from the line the dry run logs for it:
`[  12/  51]  blk.0.ffn_gate_exps.weight  - [ 256, 128, 8, 1], type = f16, size = ... (q4_K)`.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import gguf
import llama_cpp
import llama_cpp._logger
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter

from stratad.model.synthetic import writer as synth

_LINE = re.compile(
    r"\[\s*\d+/\s*\d+\]\s+(?P<name>\S+)\s+- \[.*\], type =\s+(?P<src>\w+),"
    r" size =.*?(?:\((?P<dst>\w+)\))?$"
)


def write_unquantized(p: synth.SynthPreset, path: Path) -> None:
    """Preset `p` as convert_hf_to_gguf --outtype f16 lays it out, data left as a hole."""
    w = GGUFWriter(path, p.arch)
    synth._add_metadata(w, p, 0, synth.tokenizer_source())
    size = 0
    for t in synth.tensor_plan(p):
        # norms, biases, the router and a short convolution (the converter keeps them F32)
        f32 = len(t.shape) == 1 or t.name.endswith(".bias") or any(
            part in t.name for part in ("ffn_gate_inp", "ssm_conv1d"))
        nbytes = t.rows * t.cols * (4 if f32 else 2)
        dtype = QType.F32 if f32 else QType.F16
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=dtype)
        size += GGUFWriter.ggml_pad(nbytes, gguf.GGUF_DEFAULT_ALIGNMENT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    out = w.fout[0]
    w.write_padding(out, out.tell())
    out.truncate(out.tell() + size)
    w.close()


def llama_cpp_types(source: Path, file_type: int, scratch: Path) -> dict[str, str]:
    """{tensor name: GGUF type name, upper case} that llama.cpp chooses for `source` in
    `file_type` (LLAMA_FTYPE_*), without an importance matrix."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type
    params.dry_run = True
    params.nthread = 1
    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(
            str(source).encode(), str(scratch / "unused.gguf").encode(), ctypes.byref(params)
        )
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    log = "".join(lines)
    assert rc == 0, log[-4000:]
    types = {}
    for line in log.splitlines():
        if m := _LINE.match(line):
            types[m["name"]] = (m["dst"] or m["src"]).upper()
    return types
