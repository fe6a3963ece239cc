"""The gated delta rule (`kernels.layers.delta_rule`): the Triton kernel against its torch
reference on ragged shapes (value dims past one block, key heads shared by two value heads,
q and k as views of the convolution's output), one launch against two that continue the
state, and the reference against the rule's closed form for one token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as fn

from kernels.layers.delta_rule import DeltaRuleConfig, gated_delta_rule, gated_delta_rule_ref
from tests.kernel_cases import randn
from tests.sm90_compile import compile_case

HK, HV, DK, DV = 2, 4, 16, 24  # two value heads per key head; 24 value dims: blocks of 16


def _inputs(t: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(q, k, v, ba, dt_bias, a, state) as a layer hands them over: q, k and v views of one
    [T, 2 Hk Dk + Hv Dv] buffer."""
    mixed = randn(t, 2 * HK * DK + HV * DV, dtype=dtype, seed=seed)
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    ba = randn(t, 2 * HV, dtype=dtype, seed=seed + 1)
    dt_bias, a = randn(HV, seed=seed + 2), -randn(HV, seed=seed + 3).abs()
    state = randn(HV, DK, DV, seed=seed + 4) * 0.1
    return (q.view(t, HK, DK), k.view(t, HK, DK), v.view(t, HV, DV), ba, dt_bias, a, state)


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_against_reference(t: int, dtype: torch.dtype) -> None:
    q, k, v, ba, dt_bias, a, state = _inputs(t, dtype)
    want, want_state = gated_delta_rule_ref(q, k, v, ba, dt_bias, a, state.clone())
    got = gated_delta_rule(q, k, v, ba, dt_bias, a, state, DeltaRuleConfig(block_v=16))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)  # updated in place


def test_two_launches_continue_one() -> None:
    """A chunk of 5 tokens, then 3 more from the state it leaves, equals 8 in one launch."""
    q, k, v, ba, dt_bias, a, state = _inputs(8, torch.float32, seed=5)
    whole = state.clone()
    want = gated_delta_rule(q, k, v, ba, dt_bias, a, whole)
    first = gated_delta_rule(q[:5], k[:5], v[:5], ba[:5], dt_bias, a, state)
    second = gated_delta_rule(q[5:], k[5:], v[5:], ba[5:], dt_bias, a, state)
    torch.testing.assert_close(torch.cat([first, second]), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole, atol=1e-5, rtol=1e-5)


def test_reference_is_the_rule_for_one_token() -> None:
    """From an empty state one token leaves S = k beta v^T and reads o = (q . k) beta v (q and
    k normed, q scaled), whatever the decay."""
    q, k, v, ba, dt_bias, a, state = _inputs(1, torch.float32, seed=9)
    out, after = gated_delta_rule_ref(q, k, v, ba, dt_bias, a, torch.zeros_like(state))
    qn = fn.normalize(q[0].float(), dim=-1).repeat_interleave(HV // HK, 0) * DK**-0.5
    kn = fn.normalize(k[0].float(), dim=-1).repeat_interleave(HV // HK, 0)
    beta = ba[0].view(HK, 2, HV // HK)[:, 0].reshape(HV).float().sigmoid()
    s = kn[:, :, None] * (beta[:, None] * v[0].float())[:, None, :]
    torch.testing.assert_close(after, s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], (qn * kn).sum(-1)[:, None] * beta[:, None] * v[0],
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_refuses_what_it_cannot_read() -> None:
    q, k, v, ba, dt_bias, a, state = _inputs(2, torch.float32)
    with pytest.raises(ValueError, match="contiguous float32"):
        gated_delta_rule(q, k, v, ba, dt_bias, a, state.to(torch.bfloat16))
    with pytest.raises(ValueError, match="value heads"):
        gated_delta_rule(q, k, v, ba[:, :4], dt_bias, a, state)
    with pytest.raises(ValueError, match="packed"):
        gated_delta_rule(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), ba, dt_bias, a,
                         state)  # fmt: skip


def test_compiles_for_sm90() -> None:
    """The kernel compiles for an sm90 GPU (what the interpreter runs, the compiler may not)."""
    assert "_delta_rule_kernel: " in compile_case("delta_rule")
