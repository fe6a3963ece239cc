"""MXFP4 as OpenAI's checkpoints pack it (gpt-oss's `*_blocks` and `*_scales` safetensors), read
into GGUF's MXFP4 blocks: the same E2M1 values and E8M0 exponents, bit for bit.

Both hold 32 values a block with one exponent byte (2^(e - 127)). The checkpoint keeps the
exponents apart ([..., G] uint8) and packs values in order: byte j of a block's 16 holds value
2j in its low nibble and 2j + 1 in its high. GGUF's block is the exponent byte, then 16 bytes
holding value j in the low nibble and j + 16 in the high (as Q4_0 and IQ4_NL pack them).
"""

from __future__ import annotations

import torch

from kernels.formats.quant import QTensor, QType


def mxfp4_from_blocks(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> QTensor:
    """blocks [..., R, G, 16] and scales [..., R, G] (uint8) -> the MXFP4 QTensor [..., R,
    32 G]; ValueError naming `what` if they are not such a pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: MXFP4 blocks and scales are uint8, not {blocks.dtype} and"
                         f" {scales.dtype}")  # fmt: skip
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{what}: blocks {tuple(blocks.shape)} and scales"
                         f" {tuple(scales.shape)} are not [..., G, 16] and [..., G]")  # fmt: skip
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    qs = values[..., :16] | (values[..., 16:] << 4)
    data = torch.cat([scales[..., None], qs], dim=-1).flatten(-2)  # [..., R, G * 17]
    *lead, g = scales.shape
    return QTensor(data.contiguous(), QType.MXFP4, (*lead, 32 * g))
