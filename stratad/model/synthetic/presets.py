"""The synthetic models' geometry: presets (a real model's shapes) and the tensors each has.

Pure description, nothing written: `stratad.model.synthetic.writer` turns a preset into a GGUF file.
A preset stores its tensors in its own fixed types; given a llama.cpp file type (`q4_k_m`)
the plan takes instead the types llama-quantize would choose
(`stratad.model.synthetic.ftype_rules`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as QType

from stratad.model.synthetic.blocks import BLOCK_TYPES
from stratad.model.synthetic.ftype_rules import Ftype, ModelShape, tensor_type

SLICE_VALUES = 1 << 21
VOCAB_SIZE = 49152  # SmolLM2's, whose tokenizer every preset borrows


class UnknownPreset(ValueError):
    """A preset name that is not in `PRESETS`; the message lists those that are."""


@dataclass(frozen=True)
class SynthPreset:
    """The geometry and storage types of one synthetic model."""

    name: str
    arch: str  # GGUF architecture: "qwen3moe" (per-head q/k norm), "glm4moe", "gpt-oss", "llama"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int  # one expert's FFN width for MoE presets, the dense FFN width otherwise
    n_experts: int = 0
    n_experts_used: int = 0
    context_length: int = 4096
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    embed_qtype: QType = QType.Q8_0  # token_embd and output
    attn_qtype: QType = QType.F16
    ffn_qtype: QType = QType.Q4_0  # the experts, or the dense FFN
    router_qtype: QType = QType.F32  # llama.cpp's quantizer keeps ffn_gate_inp in F32 too
    router_gain: float = 2.0  # spread of the router logits (1 would route almost uniformly)
    # Log-normal per-expert gain of the router rows: at 0.15 over 128 experts (top-8) the
    # hottest expert is picked about 2x as often as under uniform routing, the coldest 0.25x.
    router_row_spread: float = 0.15
    embed_std: float = 0.5  # below the layers' summed writes, so context moves the logits
    logit_gain: float = 4.0  # spread of the output logits
    # GLM-4.5's layout (arch "glm4moe"): leading dense layers of width dense_ffn, shared
    # experts (each an expert's width), RoPE over rope_dim of each head's dims, q/k/v biases;
    # its routing by sigmoid with a correction bias per expert (exp_probs_b)
    dense_layers: int = 0
    dense_ffn: int = 0
    shared_experts: int = 0
    rope_dim: int = 0  # 0: the whole head
    attn_bias: bool = False
    expert_scale: float = 1.0  # the chosen experts' weights times this (expert_weights_scale)
    # gpt-oss (arch "gpt-oss"): sinks, biases on every projection and expert, a sliding window
    # on even layers
    sliding_window: int = 0
    yarn: tuple[float, int] | None = None  # YaRN RoPE scaling: (factor, original context)
    yarn_log_mul: float = 0.0  # DeepSeek's: 0.1 * mscale_all_dim, as its converter writes it
    # DeepSeek-V2/V3 (arch "deepseek2"): multi-head latent attention of these ranks (no query
    # latent at 0), head_dim the key's unrotated part plus rope_dim, values of v_head_dim;
    # written as llama.cpp's converter does (the expansion as k_b and v_b). sigmoid: V3's
    # routing (with the correction bias), else V2's softmax.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    sigmoid: bool = False
    # Qwen3-Next (arch "qwen3next"): Gated DeltaNet layers of these heads and dims (key heads,
    # value heads, key dim, value dim; a conv of 4), full attention every 4th layer with gated
    # heads; the experts' shared expert behind a sigmoid gate
    deltanet: tuple[int, int, int, int] | None = None

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3moe", "qwen3next")

    @property
    def sigmoid_routing(self) -> bool:
        return self.arch == "glm4moe" or self.sigmoid

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def gpt_oss(self) -> bool:
        return self.arch == "gpt-oss"

    def moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.dense_layers

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def residual_scale(self) -> float:
        """Gain of every residual writer (attn_output, ffn_down): the stream stays O(1)."""
        return (2.0 * self.n_layers) ** -0.5

    def model_shape(self, tied_embeddings: bool = False) -> ModelShape:
        """The hyperparameters llama.cpp's type rules read."""
        return ModelShape(
            self.arch, self.n_layers, self.n_heads, self.n_kv_heads, self.n_experts,
            tied_embeddings,
        )


# The tiny MoE presets of the newer layouts, every tensor F32 (their llama.cpp tests compare
# in float32): tiny-moe's shapes, the biases each layout has
_TINY_F32: dict[str, Any] = dict(
    hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=64, n_experts=8, n_experts_used=2,
    rope_theta=10_000.0, rms_eps=1e-5, attn_qtype=QType.F32, ffn_qtype=QType.F32,
    embed_qtype=QType.F32, attn_bias=True,
)  # fmt: skip

PRESETS: Mapping[str, SynthPreset] = {
    p.name: p
    for p in (
        SynthPreset(
            "tiny-moe",
            "qwen3moe",
            n_layers=4,
            hidden=256,
            n_heads=4,
            n_kv_heads=2,
            head_dim=64,
            ffn=128,
            n_experts=8,
            n_experts_used=2,
        ),
        SynthPreset(
            "tiny-dense",
            "llama",
            n_layers=4,
            hidden=256,
            n_heads=4,
            n_kv_heads=2,
            head_dim=64,
            ffn=512,
            rope_theta=10_000.0,
            rms_eps=1e-5,
            attn_qtype=QType.F32,
            ffn_qtype=QType.Q8_0,
        ),
        # GLM-4.5's layout in miniature (llama.cpp computes in float32 on its F32 tensors too)
        SynthPreset("tiny-glm", "glm4moe", n_layers=3, **_TINY_F32, dense_layers=1,
                    dense_ffn=256, shared_experts=1, rope_dim=32, expert_scale=1.5),  # fmt: skip
        # gpt-oss's layout in miniature: a window of 8 that prompts outrun
        SynthPreset("tiny-gpt-oss", "gpt-oss", n_layers=4, **_TINY_F32, sliding_window=8),
        # Qwen3-Next's layout in miniature: DeltaNet in layers 0-2 (2 key heads of 32 serving
        # 4 value heads of 32: llama.cpp takes the dims equal), gated full attention with q/k
        # norms and RoPE over a quarter of each head in layer 3, a gated shared expert
        SynthPreset("tiny-qwen3-next", "qwen3next", n_layers=4,
                    **(_TINY_F32 | dict(attn_bias=False)), shared_experts=1, rope_dim=16,
                    deltanet=(2, 4, 32, 32)),  # fmt: skip
        # DeepSeek-V3's layout in miniature: latent attention with queries through a latent
        # (keys of 32 + 16 rotated dims from a latent of 64, values of 24: a latent cache row
        # is 64 + 16 wide, wider than a key, as V3's 512 + 64 against 192), a dense first
        # layer, an ungated shared expert, sigmoid routing with the correction bias, scaled
        # weights
        SynthPreset("tiny-deepseek", "deepseek2", n_layers=3,
                    **(_TINY_F32 | dict(n_kv_heads=4, head_dim=48, attn_bias=False)),
                    dense_layers=1, dense_ffn=256, shared_experts=1, rope_dim=16,
                    kv_lora_rank=64, q_lora_rank=48, v_head_dim=24, sigmoid=True,
                    expert_scale=1.5),  # fmt: skip
        # gpt-oss-20b and -120b's geometry (their config.json): MXFP4 experts as published,
        # 64 query heads of 64 over 8 KV heads, a window of 128 on even layers, YaRN x32 of
        # 4,096
        *(
            SynthPreset(
                name,
                "gpt-oss",
                n_layers=layers,
                hidden=2880,
                n_heads=64,
                n_kv_heads=8,
                head_dim=64,
                ffn=2880,
                n_experts=experts,
                n_experts_used=4,
                context_length=131072,
                rope_theta=150_000.0,
                rms_eps=1e-5,
                attn_qtype=QType.Q8_0,
                ffn_qtype=QType.MXFP4,
                attn_bias=True,
                sliding_window=128,
                yarn=(32.0, 4096),
            )
            for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))
        ),
        # GLM-4.5-Air's geometry (its config.json): 46 layers (the first dense), 128 experts
        # of 1,408 top-8 plus one shared, 96 query heads of 128 over 8 KV heads, RoPE over
        # half of each head; without its multi-token-prediction block (llama.cpp skips it).
        SynthPreset(
            "glm-4.5-air",
            "glm4moe",
            n_layers=46,
            hidden=4096,
            n_heads=96,
            n_kv_heads=8,
            head_dim=128,
            ffn=1408,
            n_experts=128,
            n_experts_used=8,
            context_length=131072,
            rms_eps=1e-5,
            attn_qtype=QType.Q8_0,
            dense_layers=1,
            dense_ffn=10944,
            shared_experts=1,
            rope_dim=64,
            attn_bias=True,
        ),
        # Qwen3-Next-80B-A3B's geometry (its config.json): Gated DeltaNet in three of every
        # four layers (16 key heads of 128 serving 32 value heads), gated full attention of
        # 16 query heads of 256 over 2 KV heads with RoPE over 64 dims, 512 experts of 512
        # top-10 plus a gated shared expert
        SynthPreset(
            "qwen3-next-80b-a3b",
            "qwen3next",
            n_layers=48,
            hidden=2048,
            n_heads=16,
            n_kv_heads=2,
            head_dim=256,
            ffn=512,
            n_experts=512,
            n_experts_used=10,
            context_length=262144,
            rope_theta=10_000_000.0,
            attn_qtype=QType.Q8_0,
            shared_experts=1,
            rope_dim=64,
            deltanet=(16, 32, 128, 128),
        ),
        # DeepSeek-V2-Lite's geometry (its config.json): latent attention of rank 512 with
        # queries projected directly, 64 experts of 1,408 top-6 by softmax plus two shared, a
        # dense first layer of 10,944, YaRN x40 of 4,096 scaling the scores too
        SynthPreset(
            "deepseek-v2-lite",
            "deepseek2",
            n_layers=27,
            hidden=2048,
            n_heads=16,
            n_kv_heads=16,
            head_dim=192,
            ffn=1408,
            n_experts=64,
            n_experts_used=6,
            context_length=163840,
            rope_theta=10000.0,
            attn_qtype=QType.Q8_0,
            dense_layers=1,
            dense_ffn=10944,
            shared_experts=2,
            rope_dim=64,
            kv_lora_rank=512,
            v_head_dim=128,
            yarn=(40.0, 4096),
            yarn_log_mul=0.0707,
        ),
        # Qwen3-30B-A3B's geometry (its config.json), at Q4_0 experts / Q8_0 the rest.
        SynthPreset(
            "a3b",
            "qwen3moe",
            n_layers=48,
            hidden=2048,
            n_heads=32,
            n_kv_heads=4,
            head_dim=128,
            ffn=768,
            n_experts=128,
            n_experts_used=8,
            context_length=40960,
            attn_qtype=QType.Q8_0,
        ),
    )
}


def get_preset(name: str) -> SynthPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(
            f"unknown synth preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None


@dataclass(frozen=True)
class SynthTensor:
    """One tensor of the plan: its GGUF name, torch-order shape, type and initialisation."""

    name: str
    shape: tuple[int, ...]  # [cols] | [rows, cols] | [experts, rows, cols]
    qtype: QType
    std: float  # values ~ N(0, std^2); 0 means the constant 1 (norm weights)
    row_spread: float = 0.0  # each row times exp(row_spread * N(0, 1))
    offset: float = 0.0  # added to the drawn values (a DeltaNet's decay rates: negative)
    # Written as random valid blocks of spread `std` (`synth_blocks`) instead of drawn and
    # quantized: the --ftype files' quantized tensors.
    random_blocks: bool = False

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        """Rows of the tensor flattened to [rows, cols]."""
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        if self.cols % block:
            raise ValueError(
                f"{self.name}: {self.cols} columns is not whole {self.qtype.name} blocks"
            )
        return self.rows * (self.cols // block) * block_bytes

    @property
    def rows_per_slice(self) -> int:
        return max(1, SLICE_VALUES // self.cols)


def tensor_plan(p: SynthPreset, ftype: Ftype | None = None) -> list[SynthTensor]:
    """Every tensor of the preset, in file order (llama.cpp's converter order): in the
    preset's own types, or in those llama-quantize gives them in `ftype`."""
    plan = _preset_plan(p)
    return plan if ftype is None else _retyped(p, plan, ftype)


def _retyped(p: SynthPreset, plan: list[SynthTensor], ftype: Ftype) -> list[SynthTensor]:
    """The plan as llama-quantize would store it in `ftype`, from a converter's output:
    norms and the router stay F32 (as convert_hf_to_gguf writes them), every other weight
    takes the type llama.cpp's rules choose for its name, shape and layer."""
    shape = p.model_shape(tied_embeddings=not any(t.name == "output.weight" for t in plan))
    out = []
    for t in plan:
        qtype = tensor_type(t.name, t.shape, ftype, shape)
        if qtype is None:
            out.append(t)
            continue
        blocks = qtype in BLOCK_TYPES
        if not blocks and qtype not in (QType.F32, QType.F16):
            raise ValueError(f"{t.name}: no random block writer for {qtype.name}")
        if blocks and t.row_spread:
            raise ValueError(f"{t.name}: random blocks cannot carry a row spread")
        out.append(replace(t, qtype=qtype, random_blocks=blocks))
    return out


def _preset_plan(p: SynthPreset) -> list[SynthTensor]:
    T = gguf.MODEL_TENSOR
    known = gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == p.arch)]
    plan: list[SynthTensor] = []

    def add(
        kind: gguf.MODEL_TENSOR,
        layer: int,
        shape: tuple[int, ...],
        qtype: QType,
        std: float,
        row_spread: float = 0.0,
        bias: bool = False,
        suffix: str = ".weight",
        offset: float = 0.0,
    ) -> None:
        assert kind in known, f"{p.arch} has no {kind.name} tensor"
        name = gguf.TENSOR_NAMES[kind].format(bid=layer) + (".bias" if bias else suffix)
        plan.append(SynthTensor(name, shape, qtype, std, row_spread, offset))

    d, f, e = p.hidden, p.ffn, p.n_experts
    fan = d**-0.5  # unit-variance outputs from a unit-RMS input
    res = p.residual_scale
    add(T.TOKEN_EMBD, -1, (VOCAB_SIZE, d), p.embed_qtype, p.embed_std)
    for i in range(p.n_layers):
        add(T.ATTN_NORM, i, (d,), QType.F32, 0.0)
        if p.mla:
            _mla_plan(p, i, add)
        elif p.deltanet and i % 4 != 3:
            _deltanet_plan(p, i, add)
        else:
            _attention_plan(p, i, add)
        post = p.arch in ("glm4moe", "qwen3next") or p.gpt_oss  # their FFN norms' GGUF name
        add(T.ATTN_POST_NORM if post else T.FFN_NORM, i, (d,), QType.F32, 0.0)
        if p.moe_layer(i):
            add(
                T.FFN_GATE_INP,
                i,
                (e, d),
                p.router_qtype,
                p.router_gain * fan,
                row_spread=p.router_row_spread,
            )
            add(T.FFN_GATE_EXP, i, (e, f, d), p.ffn_qtype, fan)
            add(T.FFN_UP_EXP, i, (e, f, d), p.ffn_qtype, fan)
            add(T.FFN_DOWN_EXP, i, (e, d, f), p.ffn_qtype, res * f**-0.5)
            if p.gpt_oss:
                add(T.FFN_GATE_INP, i, (e,), QType.F32, 0.5, bias=True)
                add(T.FFN_GATE_EXP, i, (e, f), QType.F32, 0.1, bias=True)
                add(T.FFN_UP_EXP, i, (e, f), QType.F32, 0.1, bias=True)
                add(T.FFN_DOWN_EXP, i, (e, d), QType.F32, 0.1 * res, bias=True)
            if p.sigmoid_routing:  # the correction bias: a spread like the scores'
                add(T.FFN_EXP_PROBS_B, i, (e,), QType.F32, 0.1, bias=True)
            if p.shared_experts:
                fs = f * p.shared_experts
                add(T.FFN_GATE_SHEXP, i, (fs, d), p.ffn_qtype, fan)
                add(T.FFN_UP_SHEXP, i, (fs, d), p.ffn_qtype, fan)
                add(T.FFN_DOWN_SHEXP, i, (d, fs), p.ffn_qtype, res * fs**-0.5)
            if p.deltanet:  # Qwen3-Next's shared expert sits behind a sigmoid gate
                add(T.FFN_GATE_INP_SHEXP, i, (1, d), QType.F32, fan)  # as [1, H] in files
        else:
            fd = p.dense_ffn or f
            add(T.FFN_GATE, i, (fd, d), p.ffn_qtype, fan)
            add(T.FFN_UP, i, (fd, d), p.ffn_qtype, fan)
            add(T.FFN_DOWN, i, (d, fd), p.ffn_qtype, res * fd**-0.5)
    add(T.OUTPUT_NORM, -1, (d,), QType.F32, 0.0)
    add(T.OUTPUT, -1, (VOCAB_SIZE, d), p.embed_qtype, p.logit_gain * fan)
    return plan


Add = Callable[..., None]


def _attention_plan(p: SynthPreset, i: int, add: Add) -> None:
    """Layer i's q/k/v attention (with the biases and sinks its layout has)."""
    T, d = gguf.MODEL_TENSOR, p.hidden
    fan, res = d**-0.5, p.residual_scale
    # Qwen3-Next's heads: each head's query, then its output's gate
    add(T.ATTN_Q, i, (2 * p.q_dim if p.deltanet else p.q_dim, d), p.attn_qtype, fan)
    if p.attn_bias:
        add(T.ATTN_Q, i, (p.q_dim,), QType.F32, 0.1, bias=True)
    add(T.ATTN_K, i, (p.kv_dim, d), p.attn_qtype, fan)
    if p.attn_bias:
        add(T.ATTN_K, i, (p.kv_dim,), QType.F32, 0.1, bias=True)
    add(T.ATTN_V, i, (p.kv_dim, d), p.attn_qtype, fan)
    if p.attn_bias:
        add(T.ATTN_V, i, (p.kv_dim,), QType.F32, 0.1, bias=True)
    add(T.ATTN_OUT, i, (d, p.q_dim), p.attn_qtype, res * p.q_dim**-0.5)
    if p.gpt_oss:
        add(T.ATTN_OUT, i, (d,), QType.F32, 0.1, bias=True)
        add(T.ATTN_SINKS, i, (p.n_heads,), QType.F32, 1.0)
    if p.qk_norm:
        add(T.ATTN_Q_NORM, i, (p.head_dim,), QType.F32, 0.0)
        add(T.ATTN_K_NORM, i, (p.head_dim,), QType.F32, 0.0)


def _deltanet_plan(p: SynthPreset, i: int, add: Add) -> None:
    """Layer i's Gated DeltaNet as llama.cpp's converter writes it: every head's q, k, v in
    one projection, the gate z apart, the conv [C, 4], the decay rates a < 0 (-exp(A_log))."""
    assert p.deltanet is not None
    T, d = gguf.MODEL_TENSOR, p.hidden
    kh, vh, dk, dv = p.deltanet
    conv, value = 2 * kh * dk + vh * dv, vh * dv
    add(T.ATTN_QKV, i, (conv, d), p.attn_qtype, d**-0.5)
    add(T.ATTN_GATE, i, (value, d), p.attn_qtype, d**-0.5)
    add(T.SSM_BETA_ALPHA, i, (2 * vh, d), p.attn_qtype, d**-0.5)
    add(T.SSM_CONV1D, i, (conv, 4), QType.F32, 0.5)
    add(T.SSM_DT, i, (vh,), QType.F32, 0.5, bias=True)
    add(T.SSM_A, i, (vh,), QType.F32, 0.3, suffix="", offset=-1.5)
    add(T.SSM_NORM, i, (dv,), QType.F32, 0.0)
    add(T.SSM_OUT, i, (d, value), p.attn_qtype, p.residual_scale * value**-0.5)


def _mla_plan(p: SynthPreset, i: int, add: Add) -> None:
    """Layer i's multi-head latent attention as llama.cpp's converter writes it: the query
    (through its latent where q_lora_rank is set), the key/value latent with the shared
    rotated key, the expansion split into k_b [H, rank, nope] and v_b [H, v, rank]."""
    T, d, h, rank = gguf.MODEL_TENSOR, p.hidden, p.n_heads, p.kv_lora_rank
    fan, res, nope = d**-0.5, p.residual_scale, p.head_dim - p.rope_dim
    if p.q_lora_rank:
        add(T.ATTN_Q_A, i, (p.q_lora_rank, d), p.attn_qtype, fan)
        add(T.ATTN_Q_A_NORM, i, (p.q_lora_rank,), QType.F32, 0.0)
        add(T.ATTN_Q_B, i, (p.q_dim, p.q_lora_rank), p.attn_qtype, p.q_lora_rank**-0.5)
    else:
        add(T.ATTN_Q, i, (p.q_dim, d), p.attn_qtype, fan)
    add(T.ATTN_KV_A_MQA, i, (rank + p.rope_dim, d), p.attn_qtype, fan)
    add(T.ATTN_KV_A_NORM, i, (rank,), QType.F32, 0.0)
    add(T.ATTN_K_B, i, (h, rank, nope), QType.F32, rank**-0.5)
    add(T.ATTN_V_B, i, (h, p.v_head_dim, rank), QType.F32, rank**-0.5)
    add(T.ATTN_OUT, i, (d, h * p.v_head_dim), p.attn_qtype, res * (h * p.v_head_dim) ** -0.5)


def data_nbytes(p: SynthPreset, ftype: Ftype | None = None) -> int:
    """Bytes of tensor data in the file (each tensor padded to GGUF's 32-byte alignment)."""
    plan = tensor_plan(p, ftype)
    return sum(GGUFWriter.ggml_pad(t.nbytes, gguf.GGUF_DEFAULT_ALIGNMENT) for t in plan)


def n_params(p: SynthPreset) -> int:
    return sum(t.rows * t.cols for t in tensor_plan(p))


# --- drawing and encoding ------------------------------------------------------------------
