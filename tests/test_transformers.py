"""The reference engine against transformers on tiny random checkpoints of each architecture.

Each test builds a model with random weights, saves it with `save_pretrained` (fp32
safetensors), loads the directory with Strata's reader and compares logits in fp32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from stratad.engine.reference.forward import ReferenceForward
from stratad.model.graph.rope_scaling import Linear, RopeScaling, Yarn
from stratad.model.graph.routing import GroupedSoftmax, Softmax
from stratad.model.spec import Model, ModelError
from stratad.store.loader import load_model
from stratad.store.pack.manifest import PackError
from stratad.store.pack.write import write_pack

COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than the default so that logits and routing vary
    rms_norm_eps=1e-6,
)

CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, dict(intermediate_size=96, rope_theta=10000.0)),
    "qwen2": (tf.Qwen2Config, dict(intermediate_size=96)),
    "qwen3": (tf.Qwen3Config, dict(intermediate_size=96, head_dim=16, tie_word_embeddings=True)),
    "qwen3moe": (
        tf.Qwen3MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
        ),
    ),
    "qwen2moe": (
        tf.Qwen2MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    "mixtral": (
        tf.MixtralConfig,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    ),
    "olmoe": (tf.OlmoeConfig, dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    # gpt-oss: sinks, a sliding window of 8 on even layers (the 24 tokens outrun it), biases
    # everywhere, top-k softmax routing, clamped SwiGLU experts stored fused in the checkpoint
    "gpt-oss": (
        tf.GptOssConfig,
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            sliding_window=8,
            swiglu_limit=0.5,  # low enough that the random activations reach it
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # GLM-4.5's layout: a dense first layer, sigmoid routing with a correction bias (drawn in
    # `_build`) within the best 2 of 4 groups, scaled weights, an ungated shared expert, RoPE
    # over half of each head, q/k/v biases and per-head q/k norms.
    "glm4moe": (
        tf.Glm4MoeConfig,
        dict(
            num_hidden_layers=3,
            intermediate_size=96,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "rope_type": "default"},
        ),
    ),
    # DeepSeek-V3's layout: multi-head latent attention with queries through a latent and
    # values narrower than keys, a dense first layer, sigmoid routing with a correction bias
    # within the best 2 of 4 groups, scaled weights, an ungated shared expert
    "deepseek2": (
        tf.DeepseekV3Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=96,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        ),
    ),
    # Qwen3-Next's layout: Gated DeltaNet in three of every four layers (2 key heads serving
    # 4 value heads, a conv of 4), gated full attention in the fourth with RoPE over a quarter
    # of each head, 8 experts top-2 and a gated shared expert; norms that scale by 1 + w
    # (drawn in `_build`, as the layers' biases are)
    "qwen3next": (
        tf.Qwen3NextConfig,
        dict(
            num_hidden_layers=4,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "rope_type": "default"},
        ),
    ),
}


def _build(
    arch: str, out: Path, config_cls: type | None = None, **override: Any
) -> tf.PreTrainedModel:
    """A random checkpoint of CASES[arch] in `out` (`config_cls`: another form of the layout,
    e.g. DeepSeek-V2's config for the deepseek2 case; `override`: config keys)."""
    cls, extra = CASES[arch]
    torch.manual_seed(0)
    config = (config_cls or cls)(**(COMMON | extra | override))
    model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    # zero at init: draw them, so that they count
    zeros = [*model.named_buffers(), *model.named_parameters()]
    with torch.no_grad():
        for name, t in zeros:
            if name.endswith(("bias", "sinks", "norm.weight")) and not t.any():
                t.copy_(torch.randn(t.shape) * 0.1)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("arch", sorted(CASES))
def test_logits_match_transformers(arch: str, tmp_path: Path) -> None:
    hf = _build(arch, tmp_path)
    model = load_model(tmp_path)
    assert model.spec.arch == arch
    _compare(hf, model, arch)


# E2M1's magnitudes, index = a nibble's low 3 bits (the top bit is the sign)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, C] (R the output rows) as OpenAI's checkpoints pack MXFP4: blocks [E, R, C/32,
    16] (byte j: value 2j low nibble, 2j + 1 high) and E8M0 scales [E, R, C/32], each group's
    exponent the least that keeps its largest value within 6."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(e)[..., None]
    nearest = (x.abs()[..., None] - _E2M1).abs().argmin(-1)
    idx = (nearest | torch.where(x < 0, 8, 0)).to(torch.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks, (e + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint(tmp_path: Path) -> None:
    """The published gpt-oss checkpoints hold their experts as MXFP4 blocks and scales: read
    into GGUF's MXFP4 blocks, the logits are transformers' over the values transformers' own
    dequantizer gives them (`convert_moe_packed_tensors`)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _build("gpt-oss", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for i, layer in enumerate(hf.model.layers):
        ex = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = _mxfp4_packed(tensors.pop(f"{ex}.{proj}").transpose(1, 2))
            tensors[f"{ex}.{proj}_blocks"], tensors[f"{ex}.{proj}_scales"] = blocks, scales
            with torch.no_grad():  # transformers' model on the values the checkpoint now holds
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, path)
    model = load_model(tmp_path)
    assert model.tensors["model.layers.0.mlp.experts.gate_proj"].qtype.name == "MXFP4"
    _compare(hf, model, "gpt-oss mxfp4")
    with pytest.raises(PackError, match="stores a layer's experts in one tensor"):
        write_pack(tmp_path, tmp_path / "pack")  # said, not a crash
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, path)
    with pytest.raises(ModelError, match="down_proj_blocks has no down_proj_scales beside it"):
        load_model(tmp_path)


# Linear and YaRN RoPE scaling on qwen3. YaRN over an original context of 1,024 at theta 100:
# pairs 0 and 1 of a head's 8 keep their frequency, 2..7 are on the ramp (from 2 to 9: both
# ends count); cos and sin x 1.139.
SCALINGS: dict[str, tuple[dict[str, Any], RopeScaling]] = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, Linear(4.0)),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        Yarn(4.0, 1024, 0.1 * math.log(4.0) + 1.0),
    ),
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_scaling_matches_transformers(kind: str, tmp_path: Path) -> None:
    params, want = SCALINGS[kind]
    hf = _build("qwen3", tmp_path, rope_parameters={"rope_theta": 100.0, **params})
    model = load_model(tmp_path)
    assert model.spec.rope_scaling == want
    _compare(hf, model, kind)


def test_deepseek_v2_lite_layout_matches_transformers(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite's form of the layout: queries projected directly, softmax routing
    without groups, unscaled, and its YaRN whose mscale_all_dim scales the attention scores
    (mscale 0.707 of both kinds, as the published config: the tables' factor is 1)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
            "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
    hf = _build("deepseek2", tmp_path, tf.DeepseekV2Config, q_lora_rank=None, n_group=1,
                topk_group=1, topk_method="greedy", routed_scaling_factor=1.0,
                n_shared_experts=2, rope_parameters=yarn)  # fmt: skip
    model = load_model(tmp_path)
    s = model.spec
    assert s.mla is not None and s.mla.q_lora_rank == 0 and s.routing == Softmax()
    assert isinstance(s.rope_scaling, Yarn) and s.rope_scaling.attn_factor == pytest.approx(1.0)
    assert s.attn_scale == pytest.approx((0.1 * 0.707 * math.log(4.0) + 1.0) ** 2)
    _compare(hf, model, "deepseek-v2-lite")


def test_deepseek_v2_group_limited_routing_matches_transformers(tmp_path: Path) -> None:
    """DeepSeek-V2's routing within groups: the softmax's top 2 within the best 2 of 4 groups
    of experts, a group ranked by its best probability, the weights scaled."""
    hf = _build("deepseek2", tmp_path, tf.DeepseekV2Config, q_lora_rank=None,
                topk_method="group_limited_greedy", n_group=4, topk_group=2)  # fmt: skip
    model = load_model(tmp_path)
    assert model.spec.routing == GroupedSoftmax(4, 2) and model.spec.expert_scale == 1.5
    _compare(hf, model, "deepseek-v2 grouped")


def _compare(hf: tf.PreTrainedModel, model: Model, what: str) -> None:
    forward = ReferenceForward(model)
    tokens = torch.randint(
        0, COMMON["vocab_size"], (24,), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0].float()
    # prefill in two chunks, then two single-token steps: exercises the KV cache path
    cache = forward.new_cache(64)
    ids = tokens.tolist()
    got = torch.cat(
        [
            forward(ids[:10], cache, all_logits=True),
            forward(ids[10:22], cache, all_logits=True),
            forward(ids[22:23], cache, all_logits=True),
            forward(ids[23:], cache, all_logits=True),
        ]
    )
    scale = expected.abs().max()
    rel = ((got - expected).abs().max() / scale).item()
    assert rel < 1e-4, f"{what}: max |diff| / max |logit| = {rel:.2e}"
    if model.spec.is_moe:  # routing was exercised, and not all on one expert
        assert (forward.route_counts > 0).sum() > model.spec.n_experts_used
