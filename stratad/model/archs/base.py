"""The llama-style decoder that every supported architecture is a variant of.

An architecture file subclasses `Arch`, states how its hyper-parameters are read from GGUF
metadata and from a Hugging Face config, and where its weights live; `register` adds it to
the table that the loaders consult.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from kernels.formats.quant import QTensor
from stratad.model.formats.shapes import check_spec
from stratad.model.graph.rope_scaling import UNSCALED, Linear, RopeScaling, Yarn, yarn_mscale
from stratad.model.spec import Model, ModelError, ModelSpec
from stratad.model.weights import (
    AttentionWeights,
    ExpertStack,
    LayerWeights,
    Mixer,
    MLPWeights,
    MoEWeights,
)

ARCHS: dict[str, type[Arch]] = {}


def register(cls: type[Arch]) -> type[Arch]:
    ARCHS[cls.name] = cls
    return cls


def hf_key(config: Mapping[str, Any], source: str, *keys: str) -> Any:
    """The first of several spellings of one config.json key (they changed across releases)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise ModelError(f"{source}: config.json has none of {', '.join(keys)}")


def _require(meta: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise ModelError(f"{source}: missing metadata key {key!r}")
    return meta[key]


class Arch:
    """A llama-style decoder: GQA attention, RMSNorm, RoPE, SiLU-gated MLP or routed experts."""

    name: ClassVar[str]
    gguf_arch: ClassVar[str]  # `general.architecture` in a GGUF file
    hf_model_types: ClassVar[tuple[str, ...]]  # `model_type` in config.json
    moe: ClassVar[bool] = False
    # GGUF files of llama-converted models carry q/k rows permuted for pair-wise RoPE.
    gguf_rope_interleaved: ClassVar[bool] = False
    attn_bias: ClassVar[bool] = False
    qk_norm: ClassVar[str] = "none"
    # Hugging Face naming of the MLP block and of one expert's projections.
    hf_mlp: ClassVar[str] = "mlp"
    hf_router: ClassVar[str] = "gate"
    hf_expert_proj: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: ClassVar[bool] = False
    hf_shared: ClassVar[str] = "shared_expert"  # the shared expert's module (with `shared_expert`)
    shared_expert_gate: ClassVar[bool] = True  # a sigmoid gate scales the shared expert's output
    hf_router_bias: ClassVar[str] = ""  # the router's bias [E] (its routing adds it), if any
    o_bias: ClassVar[bool] = False  # the attention output projection has a bias
    expert_bias: ClassVar[bool] = False  # each expert's three projections have biases
    gguf_ffn_norm: ClassVar[str] = "ffn_norm"  # GGUF name of the norm before the FFN

    # -- hyper-parameters -------------------------------------------------------------

    @classmethod
    def spec_from_gguf(cls, meta: Mapping[str, Any], source: str) -> ModelSpec:
        a = str(meta["general.architecture"])

        def get(key: str, default: Any = None) -> Any:
            full = f"{a}.{key}"
            return meta.get(full, default) if default is not None else _require(meta, full, source)

        hidden = int(get("embedding_length"))
        n_heads = _heads(int(get("attention.head_count")), source)
        vocab = int(meta.get(f"{a}.vocab_size", len(meta.get("tokenizer.ggml.tokens", []))))
        spec = ModelSpec(
            arch=cls.name,
            n_layers=int(get("block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=int(get("attention.key_length", hidden // n_heads)),
            vocab_size=vocab,
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            context_length=int(get("context_length", 4096)),
            ffn=int(get("feed_forward_length", 0)) if not cls.moe else 0,
            rope_interleaved=cls.gguf_rope_interleaved,
            attn_bias=cls.attn_bias,
            qk_norm=cls.qk_norm,
            n_experts=int(get("expert_count")) if cls.moe else 0,
            n_experts_used=int(get("expert_used_count")) if cls.moe else 0,
            expert_ffn=cls._gguf_expert_ffn(meta, a, source) if cls.moe else 0,
            shared_expert_ffn=int(get("expert_shared_feed_forward_length", 0)),
            norm_topk_prob=cls._gguf_norm_topk(meta, a),
            rope_scaling=_gguf_rope_scaling(meta, a, source),
        )
        check_spec(spec, source)
        spec.validate()
        return spec

    @classmethod
    def gguf_extra_blocks(cls, meta: Mapping[str, Any]) -> int:
        """Blocks a GGUF file holds past the model's layers (that the forward does not run)."""
        return 0

    @classmethod
    def from_tensors(cls, spec: ModelSpec, names: set[str], source: str) -> ModelSpec:
        """The spec as the GGUF file's tensor names complete it (which optional weights it
        holds, where the metadata does not say)."""
        return spec

    @classmethod
    def _gguf_expert_ffn(cls, meta: Mapping[str, Any], a: str, source: str) -> int:
        # Some converters (Mixtral, OLMoE) give the expert width as the dense FFN length.
        key = f"{a}.expert_feed_forward_length"
        return int(meta.get(key) or _require(meta, f"{a}.feed_forward_length", source))

    @classmethod
    def _gguf_norm_topk(cls, meta: Mapping[str, Any], a: str) -> bool:
        return bool(meta.get(f"{a}.expert_weights_norm", False))

    @classmethod
    def spec_from_hf(cls, config: Mapping[str, Any], source: str) -> ModelSpec:
        def get(key: str, default: Any = None) -> Any:
            if key in config and config[key] is not None:
                return config[key]
            if default is None:
                raise ModelError(f"{source}: config.json has no {key!r}")
            return default

        for key in ("attention_bias", "mlp_bias"):
            if config.get(key) and not cls.attn_bias:
                raise ModelError(f"{source}: {key}=true is not supported for {cls.name}")
        if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
            raise ModelError(f"{source}: models mixing dense and MoE layers are not supported")
        hidden = int(get("hidden_size"))
        n_heads = _heads(int(get("num_attention_heads")), source)
        spec = ModelSpec(
            arch=cls.name,
            n_layers=int(get("num_hidden_layers")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(get("num_key_value_heads", n_heads)),
            head_dim=int(get("head_dim", hidden // n_heads)),
            vocab_size=int(get("vocab_size")),
            rms_eps=float(get("rms_norm_eps")),
            rope_theta=float(cls._hf_rope_theta(config)),
            context_length=int(get("max_position_embeddings", 4096)),
            ffn=int(get("intermediate_size", 0)) if not cls.moe else 0,
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            attn_bias=cls.attn_bias,
            qk_norm=cls.qk_norm,
            rope_scaling=_hf_rope_scaling(config, source),
            **cls._hf_moe_fields(config, source),
        )
        check_spec(spec, source)
        spec.validate()
        return spec

    @classmethod
    def _hf_rope_theta(cls, config: Mapping[str, Any]) -> float:
        params = config.get("rope_parameters") or {}
        return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))

    @classmethod
    def _hf_moe_fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {}

    # -- weights ----------------------------------------------------------------------

    @classmethod
    def gguf_names(cls, spec: ModelSpec) -> dict[str, str]:
        """GGUF tensor name → Hugging Face name (stacked names for routed experts)."""
        names = {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        }
        for i in range(spec.n_layers):
            blk, hf = f"blk.{i}", f"model.layers.{i}"
            attn = f"{hf}.self_attn"
            names |= {
                f"{blk}.attn_norm.weight": f"{hf}.input_layernorm.weight",
                f"{blk}.{cls.gguf_ffn_norm}.weight": f"{hf}.post_attention_layernorm.weight",
                f"{blk}.attn_q.weight": f"{attn}.q_proj.weight",
                f"{blk}.attn_k.weight": f"{attn}.k_proj.weight",
                f"{blk}.attn_v.weight": f"{attn}.v_proj.weight",
                f"{blk}.attn_output.weight": f"{attn}.o_proj.weight",
                f"{blk}.attn_q.bias": f"{attn}.q_proj.bias",
                f"{blk}.attn_k.bias": f"{attn}.k_proj.bias",
                f"{blk}.attn_v.bias": f"{attn}.v_proj.bias",
                f"{blk}.attn_q_norm.weight": f"{attn}.q_norm.weight",
                f"{blk}.attn_k_norm.weight": f"{attn}.k_norm.weight",
                f"{blk}.attn_output.bias": f"{attn}.o_proj.bias",
                f"{blk}.attn_sinks.weight": f"{attn}.sinks",
            }
            mlp = f"{hf}.{cls.hf_mlp}"
            if not spec.moe_layer(i):
                names |= {
                    f"{blk}.ffn_gate.weight": f"{mlp}.gate_proj.weight",
                    f"{blk}.ffn_up.weight": f"{mlp}.up_proj.weight",
                    f"{blk}.ffn_down.weight": f"{mlp}.down_proj.weight",
                }
                continue
            g, u, d = cls.hf_expert_proj
            shared = f"{mlp}.{cls.hf_shared}"
            names |= {
                f"{blk}.ffn_gate_inp.weight": f"{mlp}.{cls.hf_router}.weight",
                f"{blk}.exp_probs_b.bias": f"{mlp}.{cls.hf_router}.e_score_correction_bias",
                f"{blk}.ffn_gate_inp.bias": f"{mlp}.{cls.hf_router}.bias",
                f"{blk}.ffn_gate_exps.bias": f"{mlp}.experts.{g}_bias",
                f"{blk}.ffn_up_exps.bias": f"{mlp}.experts.{u}_bias",
                f"{blk}.ffn_down_exps.bias": f"{mlp}.experts.{d}_bias",
                f"{blk}.ffn_gate_exps.weight": f"{mlp}.experts.{g}",
                f"{blk}.ffn_up_exps.weight": f"{mlp}.experts.{u}",
                f"{blk}.ffn_down_exps.weight": f"{mlp}.experts.{d}",
                f"{blk}.ffn_gate_shexp.weight": f"{shared}.gate_proj.weight",
                f"{blk}.ffn_up_shexp.weight": f"{shared}.up_proj.weight",
                f"{blk}.ffn_down_shexp.weight": f"{shared}.down_proj.weight",
                f"{blk}.ffn_gate_inp_shexp.weight": f"{mlp}.shared_expert_gate.weight",
            }
        return names

    @classmethod
    def hf_tensors(
        cls, raw: dict[str, torch.Tensor], spec: ModelSpec, source: str
    ) -> Mapping[str, torch.Tensor | QTensor]:
        """A Hugging Face checkpoint's tensors under the names `layer` reads, before routed
        experts are stacked (`hf_expert_names`): as they are, unless the checkpoint stores
        them in another form (quantized ones as their GGUF encoding: gpt-oss's MXFP4)."""
        return raw

    @classmethod
    def hf_expert_names(cls, spec: ModelSpec, layer: int) -> dict[str, str]:
        """Stacked name → per-expert name template (`{e}` is the expert index)."""
        mlp = f"model.layers.{layer}.{cls.hf_mlp}"
        return {f"{mlp}.experts.{p}": f"{mlp}.experts.{{e}}.{p}.weight" for p in cls.hf_expert_proj}

    @classmethod
    def layer(cls, model: Model, i: int) -> LayerWeights:
        hf = f"model.layers.{i}"
        return LayerWeights(
            attn_norm=model.tensor(f"{hf}.input_layernorm.weight"),
            attn=cls.attention(model, i),
            ffn_norm=model.tensor(f"{hf}.post_attention_layernorm.weight"),
            mlp=cls.feed_forward(model, i),
        )

    @classmethod
    def attention(cls, model: Model, i: int) -> Mixer:
        spec, t = model.spec, model.tensor
        attn = f"model.layers.{i}.self_attn"
        return AttentionWeights(
            q=t(f"{attn}.q_proj.weight"),
            k=t(f"{attn}.k_proj.weight"),
            v=t(f"{attn}.v_proj.weight"),
            o=t(f"{attn}.o_proj.weight"),
            q_bias=t(f"{attn}.q_proj.bias") if spec.attn_bias else None,
            k_bias=t(f"{attn}.k_proj.bias") if spec.attn_bias else None,
            v_bias=t(f"{attn}.v_proj.bias") if spec.attn_bias else None,
            q_norm=t(f"{attn}.q_norm.weight") if spec.qk_norm != "none" else None,
            k_norm=t(f"{attn}.k_norm.weight") if spec.qk_norm != "none" else None,
            o_bias=t(f"{attn}.o_proj.bias") if cls.o_bias else None,
            sinks=t(f"{attn}.sinks") if spec.attn_sinks else None,
        )

    @classmethod
    def feed_forward(cls, model: Model, i: int) -> MLPWeights | MoEWeights:
        spec, t = model.spec, model.tensor
        mlp = f"model.layers.{i}.{cls.hf_mlp}"
        block: MLPWeights | MoEWeights
        if not spec.moe_layer(i):
            block = MLPWeights(
                t(f"{mlp}.gate_proj.weight"),
                t(f"{mlp}.up_proj.weight"),
                t(f"{mlp}.down_proj.weight"),
            )
        else:
            g, u, d = cls.hf_expert_proj
            shared = None
            gated = cls.shared_expert and cls.shared_expert_gate
            if cls.shared_expert:
                s = f"{mlp}.{cls.hf_shared}"
                shared = MLPWeights(
                    t(f"{s}.gate_proj.weight"), t(f"{s}.up_proj.weight"), t(f"{s}.down_proj.weight")
                )
            ex = f"{mlp}.experts"
            biases = (t(f"{ex}.{g}_bias"), t(f"{ex}.{u}_bias"), t(f"{ex}.{d}_bias")
                      ) if cls.expert_bias else (None, None, None)  # fmt: skip
            block = MoEWeights(
                router=t(f"{mlp}.{cls.hf_router}.weight"),
                experts=ExpertStack(t(f"{ex}.{g}"), t(f"{ex}.{u}"), t(f"{ex}.{d}"), *biases),
                shared=shared,
                shared_gate=t(f"{mlp}.shared_expert_gate.weight") if gated else None,
                router_bias=(t(f"{mlp}.{cls.hf_router}.{cls.router_bias_name(spec)}")
                             if cls.router_bias_name(spec) else None),  # fmt: skip
            )
        return block

    @classmethod
    def router_bias_name(cls, spec: ModelSpec) -> str:
        """The router's bias [E] under the router's module, if the model has one."""
        return cls.hf_router_bias


def _gguf_rope_scaling(meta: Mapping[str, Any], a: str, source: str) -> RopeScaling:
    """`{arch}.rope.scaling.*` as llama.cpp reads them: no factor (or 1) is no scaling."""
    key = f"{a}.rope.scaling"
    kind = str(meta.get(f"{key}.type", "linear"))
    factor = float(meta.get(f"{key}.factor", 0.0) or 0.0)
    if kind == "none" or factor in (0.0, 1.0):
        return UNSCALED
    if kind == "linear":
        return Linear(factor)
    if kind != "yarn":
        raise ModelError(f"{source}: RoPE scaling {kind!r} is not supported (none, linear, yarn)")
    log_mul = float(meta.get(f"{key}.yarn_log_multiplier", 0.0) or 0.0)
    attn = yarn_mscale(factor) / yarn_mscale(factor, log_mul) if log_mul else yarn_mscale(factor)
    return Yarn(
        factor,
        int(meta.get(f"{key}.original_context_length") or _require(meta, f"{a}.context_length",
                                                                    source)),
        attn * float(meta.get(f"{key}.attn_factor", 1.0) or 1.0),
        float(meta.get(f"{key}.yarn_beta_fast", 32.0) or 32.0),
        float(meta.get(f"{key}.yarn_beta_slow", 1.0) or 1.0),
    )  # fmt: skip


def _hf_rope_scaling(config: Mapping[str, Any], source: str) -> RopeScaling:
    """config.json's `rope_scaling` (or transformers 5's `rope_parameters`), as Hugging Face's
    `modeling_rope_utils` computes it."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return UNSCALED
    factor = params.get("factor")
    if kind == "linear" and factor:
        return Linear(float(factor))
    if kind != "yarn":
        raise ModelError(f"{source}: rope_scaling {params!r} is not supported (default, linear,"
                         " yarn)")  # fmt: skip
    original = int(params.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])  # fmt: skip
    factor = float(factor or config["max_position_embeddings"] / original)
    attn = params.get("attention_factor")
    if attn is None:
        mscale, every = params.get("mscale"), params.get("mscale_all_dim")
        attn = (yarn_mscale(factor, mscale) / yarn_mscale(factor, every) if mscale and every
                else yarn_mscale(factor))  # fmt: skip
    return Yarn(factor, original, float(attn), float(params.get("beta_fast") or 32.0),
                float(params.get("beta_slow") or 1.0),
                truncate=params.get("truncate", True) is not False)  # fmt: skip


def _heads(n: int, source: str) -> int:
    """The attention head count a file states (the head dim's divisor when it states none)."""
    if n < 1:
        raise ModelError(f"{source}: attention heads is {n}; it must be at least 1")
    return n


def arch_for_gguf(meta: Mapping[str, Any], source: str) -> type[Arch]:
    name = meta.get("general.architecture")
    if name is None:
        raise ModelError(f"{source}: no general.architecture in the GGUF metadata")
    candidates = [a for a in ARCHS.values() if a.gguf_arch == name]
    if not candidates:
        known = sorted({a.gguf_arch for a in ARCHS.values()})
        raise ModelError(f"{source}: unknown architecture {name!r} (supported: {', '.join(known)})")
    # llama.cpp files Mixtral under "llama": the expert count tells them apart.
    moe = int(meta.get(f"{name}.expert_count", 0)) > 0
    for a in candidates:
        if a.moe == moe:
            return a
    raise ModelError(f"{source}: {name!r} {'with' if moe else 'without'} experts is not supported")


def arch_for_hf(config: Mapping[str, Any], source: str) -> type[Arch]:
    model_type = config.get("model_type")
    for a in ARCHS.values():
        if model_type in a.hf_model_types:
            return a
    known = sorted(t for a in ARCHS.values() for t in a.hf_model_types)
    raise ModelError(
        f"{source}: unknown architecture {model_type!r} (supported: {', '.join(known)})"
    )
