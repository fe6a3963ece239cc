"""Fused MoE for decode: every routed expert of one layer in one launch per projection.

Each expert's weights are found through a per-(layer, expert) table of byte addresses,
`table[layer, expert] = (gate, up, down)`. An address points either at a VRAM slot or at
host-mapped page-locked RAM: a missed expert is then read in place over PCIe by the kernel
itself, with no host round trip and no copy. The routing ids stay on the device, so a
decode step needs no synchronisation and can be captured in a graph.

Weights are GGUF Q4_0 blocks ([N, K/32 blocks of 18 bytes], the format of the packs we
write); gate/up are [F, H], down is [H, F]. Two launches per layer:
  1. `_gate_up_kernel`: act[s] = silu(gate_e @ x_t) * (up_e @ x_t)   for every (token, slot)
  2. `_down_kernel`:    out[t] = sum_s weight[t, s] * (down_e @ act[t, s])
The sum over slots runs inside one program, in slot order: the result is deterministic.

Three tiers as everywhere in kernels/: Triton bodies, launchers (`moe_gate_up`, `moe_down`)
that check inputs and build grids, and `fused_moe` (the operation). `fused_moe_ref` is the
torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant import QTensor, QType

Q4_0_BLOCK, Q4_0_BYTES = 32, 18


@dataclass(frozen=True)
class MoeConfig:
    """Launch settings (tuning tables override them per device)."""

    block_n: int = 16  # output rows per program
    block_b: int = 8  # Q4_0 blocks (of 32 columns) per reduction step
    num_warps: int = 4
    num_stages: int = 2


# --- Triton ------------------------------------------------------------------------------


@triton.jit
def _q4_0_rows_dot(
    w_ptr, row_bytes, rows, row_mask, x_ptr, K, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr
):
    """[BLOCK_N] float32: rows `rows` of a Q4_0 matrix at byte address w_ptr, dot x [K]."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    bb = tl.arange(0, BLOCK_B)  # block index within a step
    jj = tl.arange(0, 16)  # byte within a block's 16 packed bytes
    row_base = w_ptr + rows[:, None].to(tl.int64) * row_bytes  # [BN, 1]
    for b0 in range(0, K // 32, BLOCK_B):
        blk = b0 + bb  # [BB]
        bmask = row_mask[:, None] & (blk[None, :] < K // 32)  # [BN, BB]
        bptr = row_base + blk[None, :] * 18  # [BN, BB]: each block's fp16 scale
        lo = tl.load(bptr, mask=bmask, other=0).to(tl.uint16)
        hi = tl.load(bptr + 1, mask=bmask, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [BN, BB]
        qptr = bptr[:, :, None] + 2 + jj[None, None, :]  # [BN, BB, 16]
        q = tl.load(qptr, mask=bmask[:, :, None], other=0).to(tl.int32)
        xoff = blk[:, None] * 32 + jj[None, :]  # [BB, 16]
        xmask = blk[:, None] < K // 32
        x_lo = tl.load(x_ptr + xoff, mask=xmask, other=0.0).to(tl.float32)  # values 0..15
        x_hi = tl.load(x_ptr + xoff + 16, mask=xmask, other=0.0).to(tl.float32)  # 16..31
        v_lo = ((q & 0xF) - 8).to(tl.float32)
        v_hi = ((q >> 4) - 8).to(tl.float32)
        part = tl.sum(v_lo * x_lo[None, :, :] + v_hi * x_hi[None, :, :], axis=2)  # [BN, BB]
        acc += tl.sum(part * d, axis=1)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] activations (normed hidden states)
    ids_ptr,  # [T, k] int: routed experts
    table_ptr,  # [E, 3] int64 byte addresses of this layer's (gate, up, down)
    act_ptr,  # [T * k, F] float32 out
    H,
    F,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)  # (token, slot) pair
    t = s // TOP_K
    e = tl.load(ids_ptr + s).to(tl.int64)
    gate = tl.load(table_ptr + e * 3).to(tl.pointer_type(tl.uint8))
    up = tl.load(table_ptr + e * 3 + 1).to(tl.pointer_type(tl.uint8))
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < F
    row_bytes = (H // 32) * 18
    x = x_ptr + t.to(tl.int64) * H
    g = _q4_0_rows_dot(gate, row_bytes, rows, rmask, x, H, BLOCK_N, BLOCK_B)
    u = _q4_0_rows_dot(up, row_bytes, rows, rmask, x, H, BLOCK_N, BLOCK_B)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + s.to(tl.int64) * F + rows, act, mask=rmask)


@triton.jit
def _down_kernel(
    act_ptr,  # [T * k, F] float32
    ids_ptr,  # [T, k]
    weights_ptr,  # [T, k] float32 routing weights
    table_ptr,  # [E, 3] int64
    out_ptr,  # [T, H]
    H,
    F,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    row_bytes = (F // 32) * 18
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in range(TOP_K):
        s = t * TOP_K + slot
        e = tl.load(ids_ptr + s).to(tl.int64)
        w = tl.load(weights_ptr + s)
        down = tl.load(table_ptr + e * 3 + 2).to(tl.pointer_type(tl.uint8))
        y = _q4_0_rows_dot(
            down, row_bytes, rows, rmask, act_ptr + s.to(tl.int64) * F, F, BLOCK_N, BLOCK_B
        )
        acc += w * y
    tl.store(out_ptr + t.to(tl.int64) * H + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


# --- launchers ---------------------------------------------------------------------------


def _check(x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [T, H], got {tuple(x.shape)}")
    if ids.shape[0] != x.shape[0] or ids.dim() != 2 or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [T, k], got {tuple(ids.shape)}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"table must be int64 [E, 3], got {table.dtype} {tuple(table.shape)}")
    if not (x.device == ids.device == table.device):
        raise ValueError("x, ids and table must be on one device")


def moe_gate_up(
    x: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    ffn: int,
    config: MoeConfig = MoeConfig(),
) -> torch.Tensor:
    """x [T, H], ids [T, k], table [E, 3] -> act [T * k, F] float32."""
    _check(x, ids, table)
    t, h = x.shape
    if h % 32 or ffn % 32:
        raise ValueError(f"Q4_0 rows need multiples of 32 columns (H={h}, F={ffn})")
    act = torch.empty(t * ids.shape[1], ffn, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(ffn, config.block_n), t * ids.shape[1])
    _gate_up_kernel[grid](
        x,
        ids,
        table,
        act,
        h,
        ffn,
        TOP_K=ids.shape[1],
        BLOCK_N=config.block_n,
        BLOCK_B=config.block_b,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return act


def moe_down(
    act: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    table: torch.Tensor,
    hidden: int,
    out_dtype: torch.dtype,
    config: MoeConfig = MoeConfig(),
) -> torch.Tensor:
    """act [T * k, F], ids/weights [T, k], table [E, 3] -> out [T, H]."""
    t, k = ids.shape
    if act.shape[0] != t * k or weights.shape != ids.shape or weights.dtype != torch.float32:
        raise ValueError("act must be [T * k, F] and weights float32 [T, k]")
    out = torch.empty(t, hidden, dtype=out_dtype, device=act.device)
    grid = (triton.cdiv(hidden, config.block_n), t)
    _down_kernel[grid](
        act,
        ids,
        weights.contiguous(),
        table,
        out,
        hidden,
        act.shape[1],
        TOP_K=k,
        BLOCK_N=config.block_n,
        BLOCK_B=config.block_b,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    table: torch.Tensor,
    ffn: int,
    config: MoeConfig = MoeConfig(),
) -> torch.Tensor:
    """The routed-expert output [T, H] of one layer, experts found through `table`."""
    act = moe_gate_up(x, ids, table, ffn, config)
    return moe_down(act, ids, weights, table, x.shape[1], x.dtype, config)


# --- reference ---------------------------------------------------------------------------


def expert_table(experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[E, 3] int64 addresses of (gate, up, down) Q4_0 block tensors, one triple per expert."""
    return torch.tensor(
        [[g.data_ptr(), u.data_ptr(), d.data_ptr()] for g, u, d in experts], dtype=torch.int64
    )


def fused_moe_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[tuple[QTensor, QTensor, QTensor]],
) -> torch.Tensor:
    """Dequantize each routed expert and compute in float32, slot by slot."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    xf = x.float().cpu()
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            gate, up, down = (w.dequantize() for w in experts[int(ids[t, s])])
            h = torch.nn.functional.silu(gate @ xf[t]) * (up @ xf[t])
            out[t] += float(weights[t, s]) * (down @ h)
    return out.to(x.dtype)


def q4_0_expert(qt: QTensor) -> torch.Tensor:
    """The raw blocks of a Q4_0 weight, checked, as the kernels read them."""
    if qt.qtype != QType.Q4_0:
        raise ValueError(f"fused_moe reads Q4_0 experts, got {qt.qtype.name}")
    return qt.data.contiguous()
