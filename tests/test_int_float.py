"""kernels/formats/int_float.py and the E2M1 levels built on it: every value bit for bit, with no
int-to-float conversion in the kernels that read 4-bit codes. On the GPU where there is one
(the compiled kernels), else in Triton's interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats.int_float import _small_to_f32
from kernels.formats.iq_decode import _e2m1_doubled
from tests.kernel_cases import DEVICE

# llama.cpp's kvalues_mxfp4 (doubled E2M1 levels): code 8, E2M1's -0, is +0
KVALUES_MXFP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


@triton.jit
def _small_kernel(v_ptr, out_ptr, n, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, _small_to_f32(v, OFFSET), mask=i < n)


@triton.jit
def _e2m1_kernel(q_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _e2m1_doubled(tl.load(q_ptr + i)))


def test_small_integers_are_exact_at_every_offset() -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.cat([torch.arange(0, 64), torch.tensor([(1 << 23) - 1, (1 << 22) + 5]),
                   torch.randint(0, 1 << 23, (62,), generator=gen)]).to(torch.int32)  # fmt: skip
    for offset in (0, 8, 128):
        out = torch.full(v.shape, float("nan"), device=DEVICE)
        _small_kernel[(triton.cdiv(len(v), 64),)](v.to(DEVICE), out, len(v), OFFSET=offset,
                                                  BLOCK=64)  # fmt: skip
        assert torch.equal(out.cpu(), v.double().sub(offset).float())


def test_e2m1_levels_bit_for_bit() -> None:
    codes = torch.arange(16, dtype=torch.int32, device=DEVICE)
    out = torch.full((16,), float("nan"), device=DEVICE)
    _e2m1_kernel[(1,)](codes, out, BLOCK=16)
    out = out.cpu()
    want = torch.tensor(KVALUES_MXFP4, dtype=torch.float32)
    # the same bits, so code 8 is +0 (not -0) as in llama.cpp's table
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
