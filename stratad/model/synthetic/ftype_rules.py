"""Which GGUF type each tensor gets in a llama.cpp file type (`stratactl synth --ftype q4_k_m`).

A port of the part of llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp: its
`llama_tensor_get_type_impl`, `tensor_type_fallback`, `tensor_allows_quantization`,
`tensor_get_category` and `llama_ftype_get_default_type`) that decides the types of the
synthetic presets' tensors (llama and qwen3moe) for the file types in `FTYPES`, so that a
synthetic `q4_k_m` file holds the same mix of types `llama-quantize` would write for that
geometry. Read at llama.cpp commit 007dbbf, and from the llama.cpp that llama-cpp-python 0.3.36
vendors for what changed since (a 32-value type that does not fit a row falls back to F16, a
DeltaNet's ssm_conv1d stays F32); `tests/test_synth_ftype.py` checks it against the installed
llama.cpp's own choice (a dry-run quantization) on every tiny preset and a3b.

Not ported (the synthetic presets never meet them): the IQ1_M, IQ2_M, IQ3_XS/M, Q2_K_S,
Q3_K_S/L and IQ4 mixes, Falcon's rules, imatrix-dependent choices (no imatrix is
assumed, as for a plain `llama-quantize IN OUT TYPE`) and user overrides (--tensor-type,
--output-tensor-type, --pure).

Two llama.cpp counters are read here as the layer index: `i_attention_wv` counts attn_v
tensors and `i_ffn_down` ffn_down tensors (dense models) in the loader's order, which sorts
tensors by layer first (`weight_name_comparer`), and every layer has exactly one of each.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as QType


class UnknownFtype(ValueError):
    """A file type that is not in `FTYPES`; the message lists those that are."""


@dataclass(frozen=True)
class Ftype:
    """One llama.cpp file type (`llama-quantize`'s TYPE argument, in lower case)."""

    name: str
    file_type: LlamaFileType  # written as general.file_type (llama.cpp's LLAMA_FTYPE_*)
    default: QType  # llama_ftype_get_default_type: every quantized tensor no rule moves
    # mxfp4_moe: the type of every tensor of more than one expert, which no other rule moves
    # (llama-quantize's `ne[2] > 1`)
    experts: QType | None = None


FTYPES: Mapping[str, Ftype] = {
    f.name: f
    for f in (
        Ftype("q4_0", LlamaFileType.MOSTLY_Q4_0, QType.Q4_0),
        Ftype("q8_0", LlamaFileType.MOSTLY_Q8_0, QType.Q8_0),
        Ftype("q2_k", LlamaFileType.MOSTLY_Q2_K, QType.Q2_K),
        Ftype("q3_k_m", LlamaFileType.MOSTLY_Q3_K_M, QType.Q3_K),
        Ftype("q4_k_s", LlamaFileType.MOSTLY_Q4_K_S, QType.Q4_K),
        Ftype("q4_k_m", LlamaFileType.MOSTLY_Q4_K_M, QType.Q4_K),
        Ftype("q5_k_s", LlamaFileType.MOSTLY_Q5_K_S, QType.Q5_K),
        Ftype("q5_k_m", LlamaFileType.MOSTLY_Q5_K_M, QType.Q5_K),
        Ftype("q6_k", LlamaFileType.MOSTLY_Q6_K, QType.Q6_K),
        Ftype("iq3_s", LlamaFileType.MOSTLY_IQ3_S, QType.IQ3_S),
        Ftype("iq3_xxs", LlamaFileType.MOSTLY_IQ3_XXS, QType.IQ3_XXS),
        Ftype("iq2_xxs", LlamaFileType.MOSTLY_IQ2_XXS, QType.IQ2_XXS),
        Ftype("iq2_xs", LlamaFileType.MOSTLY_IQ2_XS, QType.IQ2_XS),
        # llama.cpp's IQ2_S file type is mostly IQ2_XS (its IQ2_M is mostly IQ2_S)
        Ftype("iq2_s", LlamaFileType.MOSTLY_IQ2_S, QType.IQ2_XS),
        Ftype("iq1_s", LlamaFileType.MOSTLY_IQ1_S, QType.IQ1_S),
        Ftype("mxfp4_moe", LlamaFileType.MOSTLY_MXFP4_MOE, QType.Q8_0, experts=QType.MXFP4),
    )
}


def get_ftype(name: str) -> Ftype:
    try:
        return FTYPES[name.lower()]
    except KeyError:
        raise UnknownFtype(
            f"unknown file type {name!r}; choose one of: {', '.join(FTYPES)}"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters llama.cpp's rules read (`qs.model.hparams`, `qs.model.arch`)."""

    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_experts: int = 0
    tied_embeddings: bool = False  # no output.weight: token_embd is quantized like it

    @property
    def n_gqa(self) -> int:
        """llama_hparams::n_gqa: query heads per KV head, integer division."""
        return self.n_heads // self.n_kv_heads if self.n_kv_heads else 0


@dataclass(frozen=True)
class Place:
    """What a rule reads about one tensor: its layer and the model."""

    layer: int
    model: ModelShape

    @property
    def use_more_bits(self) -> bool:
        """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every
        third layer between them."""
        i, n = self.layer, self.model.n_layers
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class Category(enum.Enum):
    """llama.cpp's `tensor_category` (those the presets have)."""

    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTN_V = "attn_v"  # with attn_qkv and attn_kv_b: llama.cpp's `category_is_attn_v`
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


# Substring tests in `tensor_get_category`'s order (ffn_up before ffn_gate before ffn_down).
_CATEGORY_BY_SUBSTRING: tuple[tuple[str, Category], ...] = (
    ("attn_qkv.weight", Category.ATTN_V),
    ("attn_kv_b.weight", Category.ATTN_V),
    ("attn_v.weight", Category.ATTN_V),
    ("attn_k.weight", Category.ATTN_K),
    ("attn_q.weight", Category.ATTN_Q),
    ("attn_output.weight", Category.ATTN_OUTPUT),
    ("ffn_up", Category.FFN_UP),
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
)


def category(name: str) -> Category:
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    return next((c for s, c in _CATEGORY_BY_SUBSTRING if s in name), Category.OTHER)


# --- the rules -------------------------------------------------------------------------------
# A rule gives the type a tensor moves to, or None to keep the file type's default type.

Rule = Callable[[Place], "QType | None"]


def _more_bits(qtype: QType) -> Rule:
    return lambda w: qtype if w.use_more_bits else None


def _eight_experts(qtype: QType, otherwise: QType | None) -> Rule:
    return lambda w: qtype if w.model.n_experts == 8 else otherwise


Q2_K, Q3_K, Q4_K, Q5_K = QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K
Q6_K, Q8_0 = QType.Q6_K, QType.Q8_0
IQ3_S, IQ2_S, IQ2_XXS = QType.IQ3_S, QType.IQ2_S, QType.IQ2_XXS
# llama.cpp's branch for the 1- and 2-bit i-quant file types: its own rules, and none of the
# bumps below
LOW_BIT = frozenset({"iq2_xxs", "iq2_xs", "iq2_s", "iq1_s"})


def _low_bit_attn_v(name: str) -> Rule:
    """Q4_K with grouped KV heads or experts, else IQ3_S in iq2_s, Q2_K in the others."""
    low = IQ3_S if name == "iq2_s" else Q2_K
    return lambda w: Q4_K if w.model.n_gqa >= 4 or w.model.n_experts >= 4 else low


def _low_bit_ffn_down(name: str) -> Rule:
    """The first eighth of the layers: IQ3_S in iq2_s, Q2_K in the others."""
    low = IQ3_S if name == "iq2_s" else Q2_K
    return lambda w: low if w.layer < w.model.n_layers // 8 else None


# the file types whose output.weight is Q5_K rather than Q6_K
_OUTPUT_Q5_K = LOW_BIT | {"iq3_xxs"}

# Per category, per file type: the branch of `llama_tensor_get_type_impl` it takes. File
# types missing from a category's table keep their default type there.
_RULES: Mapping[Category, Mapping[str, Rule]] = {
    Category.ATTN_V: {
        **{name: _low_bit_attn_v(name) for name in LOW_BIT},
        "q2_k": lambda w: Q4_K if w.model.n_gqa >= 4 else Q3_K,
        "iq3_s": lambda w: Q4_K if w.model.n_gqa >= 4 else None,
        "iq3_xxs": lambda w: Q4_K if w.model.n_gqa >= 4 else IQ3_S,  # IQ3_XXS with an imatrix
        "q3_k_m": lambda w: Q5_K if w.layer < 2 else Q4_K,
        "q4_k_s": lambda w: Q5_K if w.layer < 4 else None,
        "q4_k_m": _more_bits(Q6_K),
        "q5_k_m": _more_bits(Q6_K),
    },
    Category.ATTN_K: {
        **{name: _eight_experts(Q4_K, None) for name in LOW_BIT},
        "iq3_xxs": lambda w: IQ2_S,
    },
    Category.ATTN_Q: {"iq3_xxs": lambda w: IQ2_S},
    Category.FFN_DOWN: {
        **{name: _low_bit_ffn_down(name) for name in LOW_BIT},
        # (with an imatrix, the default type past the first eighth)
        "iq3_xxs": lambda w: Q4_K if w.layer < w.model.n_layers // 8 else Q3_K,
        "q2_k": lambda w: Q3_K,
        "q3_k_m": lambda w: Q5_K if w.layer < w.model.n_layers // 16 else Q4_K,
        "q4_k_s": lambda w: Q5_K if w.layer < w.model.n_layers // 8 else None,
        "q4_k_m": _more_bits(Q6_K),
        "q5_k_m": _more_bits(Q6_K),
    },
    # Mixtral-like models (exactly 8 experts) get Q5_K for a list of low-bit file types;
    # others only for Q2_K (Q3_K) and Q3_K_M (Q4_K).
    Category.ATTN_OUTPUT: {
        "q2_k": _eight_experts(Q5_K, Q3_K),
        "q3_k_m": _eight_experts(Q5_K, Q4_K),
        "q4_k_s": _eight_experts(Q5_K, None),
        "q4_k_m": _eight_experts(Q5_K, None),
        "iq3_s": _eight_experts(Q5_K, None),
        "iq3_xxs": _eight_experts(Q5_K, IQ3_S),
        # the low-bit branch: Q5_K with 8 experts, else IQ2_XXS in iq1_s, IQ3_S in iq2_s
        "iq2_xxs": _eight_experts(Q5_K, None),
        "iq2_xs": _eight_experts(Q5_K, None),
        "iq2_s": _eight_experts(Q5_K, IQ3_S),
        "iq1_s": _eight_experts(Q5_K, IQ2_XXS),
    },
    # untied (a tied one is the output's)
    Category.TOKEN_EMBD: {
        **{name: (lambda w: Q2_K) for name in ("iq2_xxs", "iq2_xs", "iq1_s")},
        "iq2_s": lambda w: IQ3_S,
        "iq3_xxs": lambda w: IQ3_S,
    },
}

# Applied after the table in every file type but the low-bit ones: llama.cpp bumps attn_v
# and attn_k of 8-expert models to Q8_0 ("trades just ~128MB"), and attn_v of
# Llama-2-70B-like models (80 layers, grouped KV heads) from Q3_K/Q4_K to Q5_K.
_BUMPS: Mapping[Category, tuple[Callable[[Place, QType], QType], ...]] = {
    Category.ATTN_V: (
        lambda w, t: Q5_K
        if w.model.arch == "llama" and w.model.n_layers == 80 and w.model.n_gqa > 1
        and t in (Q3_K, Q4_K) else t,
        lambda w, t: Q8_0 if w.model.n_experts == 8 else t,
    ),
    Category.ATTN_K: (lambda w, t: Q8_0 if w.model.n_experts == 8 else t,),
}


# `tensor_type_fallback`: a row length that is not whole blocks of the chosen type.
FALLBACK: Mapping[QType, QType] = {
    **dict.fromkeys(
        (QType.IQ1_S, QType.IQ1_M, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS,
         QType.IQ3_S, QType.IQ4_XS),
        QType.IQ4_NL,
    ),
    **dict.fromkeys((Q2_K, Q3_K, QType.TQ1_0, QType.TQ2_0), QType.Q4_0),
    Q4_K: QType.Q5_0,
    Q5_K: QType.Q5_1,
    Q6_K: Q8_0,
}


def _block(qtype: QType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def fallback(name: str, cols: int, qtype: QType) -> QType:
    """`qtype`, or llama.cpp's replacement when `cols` is not whole blocks of it."""
    if cols % _block(qtype) == 0:
        return qtype
    if qtype not in FALLBACK:
        if _block(qtype) <= 32:  # a 32-value type has no smaller block to demote to
            return QType.F16
        raise ValueError(f"{name}: no tensor type fallback is defined for {qtype.name}")
    replacement = FALLBACK[qtype]
    # "the fallback return type is still not compatible": llama.cpp stores F16.
    return replacement if cols % _block(replacement) == 0 else QType.F16


def _n_dims(shape: tuple[int, ...]) -> int:
    """`ggml_n_dims`: the dimensions up to the last of more than one value in ggml's order
    (torch's leading ones dropped: a [1, 256] gate is one-dimensional there)."""
    ones = next((i for i, n in enumerate(shape) if n > 1), len(shape) - 1)
    return len(shape) - ones


def quantizable(name: str, n_dims: int) -> bool:
    """`tensor_allows_quantization` for the presets' tensors: 2-D and 3-D weights, except
    norms, the MoE router (ffn_gate_inp) and a DeltaNet's short convolution (ssm_conv1d,
    which llama.cpp's conv op reads as F32 only), which keep the converter's type (F32)."""
    return (
        n_dims >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
    )


_LAYER = re.compile(r"blk\.(\d+)\.")


def _output_type(ftype: Ftype, cols: int) -> QType:
    """output.weight (and a tied token_embd): Q8_0 where rows are not whole blocks of the
    default type or the default is Q8_0 already, Q5_K in the 2- and 3-bit i-quant file
    types but iq3_s, otherwise Q6_K."""
    if cols % _block(ftype.default) or ftype.default == Q8_0:
        return Q8_0
    return Q5_K if ftype.name in _OUTPUT_Q5_K else Q6_K


def tensor_type(name: str, shape: tuple[int, ...], ftype: Ftype, model: ModelShape) -> QType | None:
    """The type llama-quantize gives tensor `name` of torch-order `shape` ([..., cols]) in
    `ftype`, or None where it keeps the tensor's own type (norms, the router)."""
    if not quantizable(name, _n_dims(shape)):
        return None
    cols = shape[-1]
    if ftype.experts is not None and len(shape) == 3 and shape[0] > 1:
        return fallback(name, cols, ftype.experts)
    cat = category(name)
    if cat == Category.OUTPUT or (cat == Category.TOKEN_EMBD and model.tied_embeddings):
        qtype = _output_type(ftype, cols)
    else:
        match = _LAYER.match(name)
        place = Place(int(match.group(1)) if match else -1, model)
        rule = _RULES.get(cat, {}).get(ftype.name)
        qtype = (rule(place) if rule else None) or ftype.default
        for bump in () if ftype.name in LOW_BIT else _BUMPS.get(cat, ()):
            qtype = bump(place, qtype)
    return fallback(name, cols, qtype)
