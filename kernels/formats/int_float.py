"""Small non-negative integers to float32 without a conversion instruction.

A GPU converts int32 to float32 at a fraction of its float rate (on NVIDIA parts 16 a clock
per multiprocessor against 128 fused multiply-adds), and a 4-bit weight reader converts one
code per weight: that unit, not memory, can set a decode kernel's pace. For v in [0, 2^23)
the bits v | 0x4B000000 are the float 2^23 + v exactly, so one bitwise or and one float
subtraction (both at the full rate) give v - offset exactly for any small integer offset.
"""

from __future__ import annotations

import triton
import triton.language as tl

TWO_23_BITS: tl.constexpr = tl.constexpr(0x4B000000)  # float32 2^23's bits
TWO_23: tl.constexpr = tl.constexpr(8388608.0)


@triton.jit
def _small_to_f32(v, OFFSET: tl.constexpr):
    """float32 of v - OFFSET for int32 v in [0, 2^23) and a small integer OFFSET, exactly."""
    return (v | TWO_23_BITS).to(tl.float32, bitcast=True) - (TWO_23 + OFFSET)
