"""Random expert weights for timing, laid out as the engine keeps them: one stack per
projection of a layer's experts (split Q4_0, the other types as GGUF blocks) and the table of
their addresses the fused MoE kernels read. Random blocks with small finite scales: timing
needs valid numbers, not meaningful ones (`stratad.tuning.kernel_bench`, `bench.gpu.moe_types`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kernels.formats.quant import FLOAT_QTYPES, QType, block_geometry, row_bytes

log = logging.getLogger("stratad.engine")
Mix = tuple[QType, QType, QType]  # gate, up, down


def random_blocks(qtype: QType, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """[rows, row bytes] random GGUF blocks of `qtype` whose fp16 scales are small and finite
    (every block type's first field is one but MXFP4's, an exponent byte, and some K-quants'
    second too); a float type's values are normal numbers (random bytes would hold subnormals
    and NaNs)."""
    if qtype in FLOAT_QTYPES:
        dtype = {QType.F32: torch.float32, QType.F16: torch.float16}.get(qtype, torch.bfloat16)
        values = torch.randn(rows, cols, device=device).to(dtype)
        return values.view(torch.uint8).reshape(rows, row_bytes(qtype, cols))
    block, nbytes = block_geometry(qtype)
    raw = torch.randint(0, 256, (rows * cols // block, nbytes), dtype=torch.uint8, device=device)
    scale = (torch.rand(raw.shape[0], device=device) * 1e-3).half().view(torch.uint8)
    raw[:, :2] = scale.view(-1, 2)
    if qtype in (QType.Q4_K, QType.Q5_K):
        raw[:, 2:4] = scale.view(-1, 2)
    fields = {QType.Q6_K: (208,), QType.Q2_K: (80, 82), QType.Q3_K: (108,)}
    for at in fields.get(qtype, ()):
        raw[:, at : at + 2] = scale.view(-1, 2)
    if qtype == QType.MXFP4:  # E8M0 exponent e, scale 2^(e - 128): 2^-10, about 1e-3
        raw[:, 0] = 118
    return raw.reshape(rows, row_bytes(qtype, cols))


def expert_stack(qtype: QType, n: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """[n, matrix bytes]: n matrices [rows, cols] as the engine keeps them (Q4_0 split: each
    matrix's scales, then its nibbles; the other types as GGUF blocks)."""
    blocks = random_blocks(qtype, n * rows, cols, device).reshape(n, -1)
    if qtype != QType.Q4_0:
        return blocks
    b = blocks.reshape(n, -1, 18)
    return torch.cat([b[:, :, :2].reshape(n, -1), b[:, :, 2:].reshape(n, -1)], dim=1)


@dataclass
class ExpertLayer:
    """One layer's experts of one type mix: a stack per projection and their addresses."""

    mix: Mix
    stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    table: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        ptrs = [torch.tensor([r.data_ptr() for r in s], dtype=torch.int64) for s in self.stacks]
        self.table = torch.stack(ptrs, dim=1).to(self.stacks[0].device)  # [E, 3]

    @property
    def aligned(self) -> bool:
        return all(s.stride(0) % 16 == 0 and s.data_ptr() % 16 == 0 for s in self.stacks)

    def expert_bytes(self) -> tuple[int, int, int]:
        return tuple(s.shape[1] for s in self.stacks)  # type: ignore[return-value]


def expert_layers(
    mixes: tuple[Mix, ...], hidden: int, ffn: int, n: int, device: torch.device
) -> Iterator[ExpertLayer]:
    """n experts of one layer per type mix (a mix whose blocks do not divide the rows is
    left out, said in the log: a model file cannot hold it)."""
    for mix in mixes:
        shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
        try:
            stacks = [expert_stack(q, n, r, c, device)
                      for q, (r, c) in zip(mix, shapes, strict=True)]  # fmt: skip
        except ValueError as err:
            log.warning("kernel bench: %s left out: %s", mix_name(mix), err)
            continue
        yield ExpertLayer(mix, (stacks[0], stacks[1], stacks[2]))


def mix_name(mix: Mix) -> str:
    return mix[0].name if len(set(mix)) == 1 else "/".join(q.name for q in mix)
