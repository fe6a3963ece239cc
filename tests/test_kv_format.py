"""Quantized KV formats: what a reader of the stored form gets back, and the reference engine
attending over exactly those values (what `bench.kv_ppl` measures)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.experts import CpuExperts
from stratad.engine.kv_format import FORMATS, PLAIN, Q4KV, Int8KV
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import QuantWeights
from stratad.model.spec import Model


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_model: Model) -> Model:
    return tiny_moe_model


def _keys() -> torch.Tensor:
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0))
    x[1, 0] = 0.0  # a zero head: scale 0, read back as zeros
    x[2, 1, 3] = 40.0  # an outlier channel, as keys have
    return x


def test_int8_reads_back_within_half_a_step() -> None:
    fmt, x = Int8KV(), _keys()
    q, scale = fmt.quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 2)
    assert int(q.abs().max()) == 127  # each head's largest value is the top level
    back = fmt.dequantize(q, scale)
    assert torch.all((back - x).abs() <= scale[..., None] / 2 + 1e-6)
    assert torch.equal(back[1, 0], torch.zeros(64))
    assert torch.equal(fmt.round_trip(x), back)


def test_q4_reads_back_within_half_a_step_per_group() -> None:
    fmt, x = Q4KV(), _keys()
    q, scale, low = fmt.quantize(x)
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and scale.shape == (5, 2, 2)
    back = fmt.dequantize(q, scale, low)
    step = scale.repeat_interleave(32, dim=-1)
    assert torch.all((back - x).abs() <= step / 2 + 1e-5)
    assert torch.equal(back[1, 0], torch.zeros(64))
    with pytest.raises(ValueError, match="32-value groups"):
        fmt.quantize(torch.zeros(1, 1, 48))


def test_reference_attends_over_the_quantized_cache(tiny_moe: Model) -> None:
    """The same prompt through plain, int8 and q4 KV: int8 changes the logits a little (and
    not the next token), q4 more (this random model's keys are far from 4-bit friendly)."""
    prompt = list(range(100, 140))
    out = {}
    for name, fmt in FORMATS.items():
        ref = ReferenceForward(tiny_moe, kv_format=fmt)
        out[name] = ref(prompt, ref.new_cache(64), all_logits=True)
    plain = out["plain"]
    err = {name: float((out[name] - plain).abs().max()) for name in ("int8", "q4")}
    assert 0 < err["int8"] < 0.02 * float(plain.abs().max()) and err["int8"] < err["q4"], err
    assert int(out["int8"][-1].argmax()) == int(plain[-1].argmax())


def test_cpu_layers_refuse_a_quantized_cache(smollm_model: Model) -> None:
    """The cpu engine's one-call layers write plain KV themselves: no silent plain cache."""
    weights = QuantWeights(CpuExperts(threads=1))
    with pytest.raises(ValueError, match="plain KV, not int8"):
        ReferenceForward(smollm_model, weights=weights, kv_format=Int8KV())
    assert ReferenceForward(smollm_model, weights=weights, kv_format=PLAIN).stack is not None
