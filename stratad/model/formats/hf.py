"""Reading a Hugging Face model directory: config.json plus *.safetensors (fp32/fp16/bf16, and
the packed forms an architecture reads: gpt-oss's MXFP4 experts)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels.formats.quant import QTensor, QType
from stratad.model.archs import arch_for_hf
from stratad.model.formats.shapes import check_model
from stratad.model.spec import Model, ModelError

_DTYPES = {torch.float32: QType.F32, torch.float16: QType.F16, torch.bfloat16: QType.BF16}


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (byte {e.start}): not a config.json") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON: {e}") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return config


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise ModelError(f"{f}: cannot read safetensors: {e}") from None
    return out


def _qtensor(name: str, t: torch.Tensor | QTensor, source: Path) -> QTensor:
    if isinstance(t, QTensor):  # read from its packed form (`Arch.hf_tensors`)
        return t
    qtype = _DTYPES.get(t.dtype)
    if qtype is None:
        raise ModelError(f"{source}: tensor {name!r} has dtype {t.dtype}, expected fp32/fp16/bf16")
    return QTensor(t, qtype, tuple(t.shape))


def load_hf(model_dir: Path) -> Model:
    config = read_config(model_dir)
    arch = arch_for_hf(config, str(model_dir))
    spec = arch.spec_from_hf(config, str(model_dir))
    raw = _read_safetensors(model_dir)
    tensors: dict[str, QTensor] = {}
    consumed: set[str] = set()
    past = re.compile(r"model\.layers\.(\d+)\.")  # layers the forward does not run (MTP)
    raw = {n: t for n, t in raw.items()
           if not ((m := past.match(n)) and int(m.group(1)) >= spec.n_layers)}  # fmt: skip
    read = arch.hf_tensors(raw, spec, str(model_dir))
    if spec.is_moe:
        for layer in spec.moe_layers:
            for stacked, template in arch.hf_expert_names(spec, layer).items():
                parts = []
                for e in range(spec.n_experts):
                    name = template.format(e=e)
                    if name not in read:
                        raise ModelError(f"{model_dir}: missing tensor {name!r}")
                    part = read[name]
                    if isinstance(part, QTensor):
                        raise ModelError(f"{model_dir}: {name!r} is quantized: stacked experts"
                                         " are read as floats")  # fmt: skip
                    parts.append(part)
                    consumed.add(name)
                tensors[stacked] = _qtensor(stacked, torch.stack(parts), model_dir)
    for name, t in read.items():
        if name not in consumed:
            tensors[name] = _qtensor(name, t, model_dir)
    if spec.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    model = Model(spec=spec, tensors=tensors, source=model_dir, metadata=config)
    check_model(model, [arch.layer(model, i) for i in range(spec.n_layers)])
    model.tensor("model.embed_tokens.weight")
    model.tensor("model.norm.weight")
    return model
