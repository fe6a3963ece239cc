"""The Triton writer of the int8 KV format (`kernels.formats.kv_int8`): one head's values
quantized in a kernel (QMAX = 127 written as a literal: a jit function reads no Python
global), bit for bit `quantize_kv`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rint(y):
    """float32 -> int32 rounded half to even (torch.round's rule), from floor alone: the
    interpreter runs no libdevice, and floor(y + 0.5) rounds 0.49999997 up. y - floor(y) is
    exact in float32."""
    r = tl.floor(y)
    f = y - r
    ri = r.to(tl.int32)
    up = (f > 0.5) | ((f == 0.5) & ((ri & 1) == 1))
    return ri + up.to(tl.int32)


@triton.jit
def quantize_halves(a, b):
    """One head's D values, given as two float32 halves [D/2] (any split of the D values) ->
    (int8 [D/2], int8 [D/2], float32 scale): bit for bit `quantize_kv`."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(b), axis=0))
    scale = tl.math.div_rn(amax, 127.0)  # QMAX; IEEE division ('/' is approximate on a GPU)
    safe = tl.where(scale > 0, scale, 1.0)
    qa = tl.minimum(tl.maximum(_rint(tl.math.div_rn(a, safe)), -127), 127)
    qb = tl.minimum(tl.maximum(_rint(tl.math.div_rn(b, safe)), -127), 127)
    return qa.to(tl.int8), qb.to(tl.int8), scale
