"""Triton loads of GGUF block fields at byte addresses, correct at any alignment (a block's
fields are rarely aligned to their size: a Q8_0 block is 34 bytes, an IQ3_XXS block 98, an
MXFP4 block 17)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_f16(ptr, mask):
    """The little-endian fp16 at byte address `ptr`, as float32 (any alignment)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _load_u16(ptr, mask):
    """The little-endian uint16 at byte address `ptr`, as int32 (any alignment)."""
    return _load_u8(ptr, mask) | (_load_u8(ptr + 1, mask) << 8)


@triton.jit
def _load_u32(ptr, mask):
    """The little-endian uint32 at byte address `ptr`, as int32 bits (any alignment)."""
    return _load_u16(ptr, mask) | (_load_u16(ptr + 2, mask) << 16)


@triton.jit
def _load_e8m0_half(ptr, mask):
    """The E8M0 exponent byte e at byte address `ptr` as float32 2^(e - 128), half the scale
    it encodes (llama.cpp's ggml_e8m0_to_fp32_half, from the bits: e < 2 are subnormals)."""
    e = _load_u8(ptr, mask)
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
