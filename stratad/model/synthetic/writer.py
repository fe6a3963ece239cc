"""Synthetic models: deterministic random weights with a real architecture's geometry, as GGUF.

`write_synth(PRESETS["a3b"], path)` writes a file that llama.cpp loads and that Strata reads
like any other GGUF: the Qwen3-30B-A3B geometry (48 layers x 128 experts, top-8) with random
weights and SmolLM2's tokenizer, so text goes in and comes out. It is the stand-in for a real
model in speed measurements, where only the shapes and the bytes' layout matter.

Three properties hold:
- Deterministic: a tensor is cut into fixed slices of rows, and each slice draws from its own
  generator seeded by (seed, tensor name, slice index). Same preset and seed, same bytes,
  whatever the order the tensors are written in.
- Streaming: the header and tensor infos are written first, then one slice at a time is drawn,
  quantized (gguf-py's port of llama.cpp's reference quantizers) and appended, so memory stays
  at a few tens of MB however large the file. With a llama.cpp file type (`ftype=q4_k_m`),
  every tensor takes the type llama-quantize would give it (`ftype_rules`) and the quantized
  ones are written as random valid blocks of the same spread (`synth_blocks`): nothing to
  quantize, so the file is written about as fast as the disk takes it.
- Alive: weights are scaled so that activations keep an O(1) scale through every layer
  (residual writers scaled by 1/sqrt(2 * layers)), attention scores have unit spread, logits
  a spread of about 4, and the router rows carry a log-normal gain so that some experts are
  chosen more often than others.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants

from stratad.model.default import default_model_path
from stratad.model.synthetic import blocks as synth_blocks
from stratad.model.synthetic.ftype_rules import FTYPES, Ftype, UnknownFtype, get_ftype
from stratad.model.synthetic.presets import (  # re-exported: the presets are part of this API
    PRESETS,
    VOCAB_SIZE,
    SynthPreset,
    SynthTensor,
    UnknownPreset,
    data_nbytes,
    get_preset,
    n_params,
    tensor_plan,
)

# Values drawn per generator call. Part of the file format's definition: changing it changes
# every file (but never the geometry).

__all__ = [
    "FTYPES",
    "Ftype",
    "PRESETS",
    "SynthPreset",
    "SynthTensor",
    "UnknownFtype",
    "UnknownPreset",
    "data_nbytes",
    "get_ftype",
    "get_preset",
    "n_params",
    "tensor_plan",
    "tokenizer_source",
    "write_synth",
    "write_tokenizer_gguf",
]

ProgressFn = Callable[[int, int], None]  # (bytes written, total bytes)


def _slice_seed(seed: int, name: str, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _draw(t: SynthTensor, seed: int, index: int, rows: int) -> np.ndarray:
    """The float32 values of rows [index * rows_per_slice, + rows) of `t` flattened to 2-D."""
    if t.std == 0.0:
        return np.ones((rows, t.cols), dtype=np.float32)
    g = torch.Generator().manual_seed(_slice_seed(seed, t.name, index))
    w = torch.randn(rows, t.cols, generator=g).mul_(t.std)  # [rows, cols]
    if t.row_spread:
        w.mul_(torch.randn(rows, 1, generator=g).mul_(t.row_spread).exp_())
    return w.add_(t.offset).numpy()


def _encode(values: np.ndarray, qtype: QType) -> np.ndarray:
    """GGUF bytes of float32 values [rows, cols], as llama.cpp's reference quantizer writes them."""
    # gguf-py's numpy quantizer runs at about 240 M values/s (Q4_0) on one core here, as fast
    # as a vectorized torch port measured beside it; a3b's 30 G values take ~5 min, split
    # about evenly between this and torch.randn.
    out = gguf_quants.quantize(values, qtype)
    return np.ascontiguousarray(out).view(np.uint8)


def _slice_bytes(job: tuple[SynthTensor, int, int, int]) -> np.ndarray:
    t, seed, index, rows = job
    if t.random_blocks:
        blocks = synth_blocks.random_blocks(
            t.qtype, rows * t.cols, t.std, _slice_seed(seed, t.name, index)
        )
        return blocks.reshape(-1)
    torch.set_num_threads(1)
    return _encode(_draw(t, seed, index, rows), t.qtype)


def _jobs(plan: list[SynthTensor], seed: int) -> Iterator[tuple[SynthTensor, int, int, int]]:
    for t in plan:
        step = t.rows_per_slice
        for index, start in enumerate(range(0, t.rows, step)):
            yield t, seed, index, min(step, t.rows - start)


def _slices(plan: list[SynthTensor], seed: int, workers: int) -> Iterator[np.ndarray]:
    """Every slice's bytes in file order; slices are independent, so workers may share them.

    Only drawn slices (torch.randn, then a quantizer) go to the workers. Random-block slices
    are made here: this process makes them at about 1 GB/s, faster than a worker's result
    comes back through the pool's pipe (about 100 MB/s measured on 2 cores). An --ftype file
    draws nothing else than F32 norms and routers (a fraction of a second of randn for a3b),
    not worth starting workers that import torch for (about 2 s each), so it has no pool.
    """
    jobs = list(_jobs(plan, seed))
    drawn = [j for j in jobs if not j[0].random_blocks]
    if workers <= 1 or all(t.qtype == QType.F32 for t, _, _, _ in drawn):
        yield from map(_slice_bytes, jobs)
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        from_pool = pool.imap(_slice_bytes, drawn, chunksize=1)
        for job in jobs:
            yield _slice_bytes(job) if job[0].random_blocks else next(from_pool)


# --- the tokenizer -------------------------------------------------------------------------


def tokenizer_source() -> Path:
    """The GGUF whose tokenizer the presets borrow: $STRATA_SYNTH_TOKENIZER if set (e.g. a
    tokenizer-only file made by `write_tokenizer_gguf`), else SmolLM2-135M-Instruct."""
    from stratad.env import Env

    override = Env.read().synth_tokenizer
    return Path(override) if override else default_model_path()


def write_tokenizer_gguf(src: Path, dst: Path) -> None:
    """A GGUF holding only `src`'s tokenizer (a few MB): enough for synthetic models."""
    w = GGUFWriter(dst, "llama")
    for key, value, vtype, sub in _tokenizer_fields(Path(src)):
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_Field = tuple[str, Any, GGUFValueType, GGUFValueType | None]  # key, value, type, item type


@cache
def _tokenizer_fields(path: Path) -> tuple[_Field, ...]:
    """Every `tokenizer.*` key of a GGUF, with its value types, ready for `add_key_value`."""
    reader = GGUFReader(path, "r")
    fields: list[_Field] = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub))
    tokens = next((v for k, v, _, _ in fields if k == gguf.Keys.Tokenizer.LIST), None)
    if tokens is None or len(tokens) != VOCAB_SIZE:
        n = "no" if tokens is None else len(tokens)
        raise ValueError(f"{path}: expected a {VOCAB_SIZE}-token vocabulary, found {n} tokens")
    return tuple(fields)


# --- writing -------------------------------------------------------------------------------

_FILE_TYPE = {
    QType.F32: LlamaFileType.ALL_F32,
    QType.F16: LlamaFileType.MOSTLY_F16,
    QType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    QType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    QType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,  # gpt-oss's presets: MXFP4 experts
}


def _add_metadata(
    w: GGUFWriter, p: SynthPreset, seed: int, tokenizer: Path, ftype: Ftype | None = None
) -> None:
    w.add_type("model")
    w.add_name(f"strata-synth-{p.name}")
    w.add_string("strata.synth.preset", p.name)
    w.add_uint64("strata.synth.seed", seed)
    if ftype is None:
        w.add_file_type(_FILE_TYPE[p.ffn_qtype])
    else:  # only then: a preset-typed file keeps its bytes
        w.add_string("strata.synth.ftype", ftype.name)
        w.add_file_type(ftype.file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(VOCAB_SIZE)
    w.add_context_length(p.context_length)
    w.add_embedding_length(p.hidden)
    w.add_block_count(p.n_layers)
    w.add_head_count(p.n_heads)
    if p.mla:  # llama.cpp caches the latent: one "KV head" of the latent and rotated key
        w.add_head_count_kv(1)
        w.add_key_length(p.kv_lora_rank + p.rope_dim)
        w.add_value_length(p.kv_lora_rank)
        w.add_key_length_mla(p.head_dim)
        w.add_value_length_mla(p.v_head_dim)
        w.add_q_lora_rank(p.q_lora_rank)
        w.add_kv_lora_rank(p.kv_lora_rank)
    else:
        w.add_head_count_kv(p.n_kv_heads)
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
    w.add_rope_dimension_count(p.rope_dim or p.head_dim)
    w.add_rope_freq_base(p.rope_theta)
    w.add_layer_norm_rms_eps(p.rms_eps)
    if p.is_moe:
        w.add_expert_count(p.n_experts)
        w.add_expert_used_count(p.n_experts_used)
        w.add_expert_feed_forward_length(p.ffn)
    else:
        w.add_feed_forward_length(p.ffn)
    if p.dense_layers:
        w.add_leading_dense_block_count(p.dense_layers)
        w.add_feed_forward_length(p.dense_ffn)
    if p.shared_experts:
        w.add_expert_shared_count(p.shared_experts)
    if p.sliding_window:
        w.add_sliding_window(p.sliding_window)
    if p.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.yarn[0])
        w.add_rope_scaling_orig_ctx_len(p.yarn[1])
        if p.yarn_log_mul:
            w.add_rope_scaling_yarn_log_mul(p.yarn_log_mul)
    if p.deltanet:
        kh, vh, dk, dv = p.deltanet
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(kh)
        w.add_ssm_time_step_rank(vh)
        w.add_ssm_inner_size(vh * dv)
        w.add_full_attention_interval(4)
        w.add_expert_shared_feed_forward_length(p.ffn * p.shared_experts)
    if p.sigmoid_routing:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(p.expert_scale)
    elif p.mla:  # DeepSeek-V2's softmax, its weights scaled and not renormalised
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_weights_scale(p.expert_scale)
    for key, value, vtype, sub in _tokenizer_fields(tokenizer):
        w.add_key_value(key, value, vtype, sub)


def write_synth(
    p: SynthPreset,
    path: Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    tokenizer: Path | None = None,
    on_progress: ProgressFn | None = None,
    workers: int = 1,
    ftype: Ftype | None = None,
) -> int:
    """Write preset `p` as a GGUF file at `path`; returns the file's size in bytes.

    `ftype` (a llama.cpp file type, e.g. `get_ftype("q4_k_m")`) stores the tensors in the
    types llama-quantize would choose; None keeps the preset's own types. The file appears
    under its name only when complete (written as `path.partial`, then renamed).
    `on_progress(done, total)` is called after every slice with tensor-data bytes.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite to replace it")
    plan = tensor_plan(p, ftype)
    total = sum(t.nbytes for t in plan)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(partial, p.arch)
    try:
        _add_metadata(w, p, seed, tokenizer or tokenizer_source(), ftype)
        for t in plan:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        out = w.fout[0]
        w.write_padding(out, out.tell())
        done = 0
        ends = {}  # byte count at which each tensor's data ends -> pad after it
        for t in plan:
            ends[done + t.nbytes] = t
            done += t.nbytes
        done = 0
        for chunk in _slices(plan, seed, workers):
            chunk.tofile(out)
            done += chunk.nbytes
            if done in ends:
                w.write_padding(out, ends[done].nbytes)
            if on_progress is not None:
                on_progress(done, total)
        w.close()
        os.replace(partial, path)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    return path.stat().st_size
