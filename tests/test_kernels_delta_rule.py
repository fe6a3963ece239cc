"""The gated delta rule (`kernels.layers.delta_rule`): the Triton kernel against its torch
reference on ragged shapes (value dims past one block, key heads shared by two value heads,
q and k as views of the convolution's output), one launch against two that continue the
state, and the reference against the rule's closed form for one token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as fn

from kernels.layers.conv_rows import causal_conv_rows, causal_conv_rows_ref
from kernels.layers.delta_rule import (
    DeltaRuleConfig,
    gated_delta_rule,
    gated_delta_rule_ref,
    gated_delta_rule_rows,
)
from stratad.engine.reference.deltanet import causal_conv
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


CHUNKED = DeltaRuleConfig(chunk_from=1, chunk=16, chunk_block_v=16)  # value blocks of 16, 8


@pytest.mark.parametrize("t", [16, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_against_reference(t: int, dtype: torch.dtype) -> None:
    """The chunked form: one whole chunk, and three with a ragged last one."""
    q, k, v, ba, dt_bias, a, state = _inputs(t, dtype, seed=t)
    want, want_state = gated_delta_rule_ref(q, k, v, ba, dt_bias, a, state.clone())
    got = gated_delta_rule(q, k, v, ba, dt_bias, a, state, CHUNKED)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-4)


def test_chunked_with_a_repeated_key() -> None:
    """A chunk that repeats one key with beta near 1 and no decay: (I + A)^-1 is small, a power
    series of A is not (binomial terms that cancel); the solve keeps every digit."""
    q, k, v, ba, dt_bias, a, state = _inputs(16, torch.float32, seed=4)
    k[:] = k[0]
    ba[:] = 8.0
    want, want_state = gated_delta_rule_ref(q, k, v, ba, dt_bias, a * 1e-4, state.clone())
    got = gated_delta_rule(q, k, v, ba, dt_bias, a * 1e-4, state, CHUNKED)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-4)


def test_chunked_then_token_by_token() -> None:
    """A prompt's 20 tokens chunked, then 2 decode steps token by token, continue one state."""
    q, k, v, ba, dt_bias, a, state = _inputs(22, torch.float32, seed=7)
    want, want_state = gated_delta_rule_ref(q, k, v, ba, dt_bias, a, state.clone())
    cfg = DeltaRuleConfig(chunk_from=8, chunk=16, chunk_block_v=16)
    got = [gated_delta_rule(q[:20], k[:20], v[:20], ba[:20], dt_bias, a, state, cfg)]
    for i in (20, 21):
        got.append(gated_delta_rule(q[i : i + 1], k[i : i + 1], v[i : i + 1], ba[i : i + 1],
                                    dt_bias, a, state, cfg))  # fmt: skip
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        gated_delta_rule(q, k, v, ba, dt_bias, a, state, DeltaRuleConfig(chunk_from=1, chunk=24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_sequences_in_one_launch(dtype: torch.dtype) -> None:
    """A decode step of 3 sequences (`gated_delta_rule_rows`: each row's state at its own
    address): each row bit for bit the one-token launch over its state alone."""
    q, k, v, ba, dt_bias, a, _ = _inputs(3, dtype, seed=11)
    states = [randn(HV, DK, DV, seed=20 + b) * 0.1 for b in range(3)]
    alone = [s.clone() for s in states]
    want = torch.cat([gated_delta_rule(q[b : b + 1], k[b : b + 1], v[b : b + 1], ba[b : b + 1],
                                       dt_bias, a, alone[b], DeltaRuleConfig(block_v=16))
                      for b in range(3)])  # fmt: skip
    table = torch.tensor([s.data_ptr() for s in states], dtype=torch.int64, device=v.device)
    got = gated_delta_rule_rows(q, k, v, ba, dt_bias, a, table, DeltaRuleConfig(block_v=16))
    assert torch.equal(got, want)
    assert all(torch.equal(s, w) for s, w in zip(states, alone, strict=True))
    with pytest.raises(ValueError, match="states: int64"):
        gated_delta_rule_rows(q, k, v, ba, dt_bias, a, table[:2])


def test_conv_rows_against_reference() -> None:
    """The batched step's convolution (`causal_conv_rows`, C = 40 over blocks of 16, K = 4):
    its reference's outputs and held inputs, and the reference the engine's
    `causal_conv` of one token."""
    c, kk = 40, 4
    x = randn(3, c, dtype=torch.bfloat16, seed=1)
    w = randn(c, kk, seed=2)
    held = [randn(c, kk - 1, seed=3 + b) for b in range(3)]
    ref_held = [h.clone() for h in held]
    table = torch.tensor([h.data_ptr() for h in held], dtype=torch.int64, device=x.device)
    got = causal_conv_rows(x, w, table, block_c=16)
    want = causal_conv_rows_ref(x, w, ref_held)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(h, r) for h, r in zip(held, ref_held, strict=True))
    one, last = causal_conv(x[:1].float(), w, (start := randn(c, kk - 1, seed=3)))
    torch.testing.assert_close(want[:1], one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_held[0], last)
    assert not torch.equal(start, last)


def test_compiles_for_sm90() -> None:
    """The kernels compile for an sm90 GPU (what the interpreter runs, the compiler may not)."""
    out = compile_case("delta_rule")
    for kernel in ("_delta_rule_solve_kernel", "_delta_rule_chunk_kernel", "_conv_rows_kernel"):
        assert f"{kernel}: " in out
    assert out.count("_delta_rule_kernel: ") == 2  # one sequence's tokens; rows of sequences
