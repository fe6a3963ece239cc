"""The paged KV layout: one pool of KV blocks per layer and device, shared by every sequence.

k_pool and v_pool are [n_slots, Hkv, D] with n_slots = n_blocks * block_size (block_size a
power of two). A sequence's cache is a list of block ids: `block_tables` [B, max_blocks]
int32, row b sequence b's ids (padded with any valid id). Position p of sequence b lives at
pool row block_tables[b, p // block_size] * block_size + p % block_size, so a sequence
reaches max_blocks * block_size positions.

The kernels that read and write this layout (`decode_attention`, `attn_input`) share the
checks here; the torch references share the gathers.
"""

from __future__ import annotations

import torch


def check_block_tables(
    block_tables: torch.Tensor, block_size: int, rows: int, n_slots: int, device: torch.device
) -> None:
    """Shapes, dtype and device only: the ids are read on the device, never here (a host
    read would sync, and break CUDA graph capture)."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two")
    if block_tables.dtype != torch.int32 or block_tables.device != device:
        raise ValueError(
            f"block_tables must be int32 on {device}, got {block_tables.dtype} on "
            f"{block_tables.device}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must be [{rows}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables needs contiguous rows (a row's ids side by side)")
    if n_slots % block_size:
        raise ValueError(f"a pool of {n_slots} slots is not whole blocks of {block_size}")


def pool_rows(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool rows of positions [B, N] of the sequences of block_tables [B, max_blocks]
    -> [B, N] int64."""
    blocks = block_tables.long().gather(1, positions // block_size)  # [B, N]
    return blocks * block_size + positions % block_size


def gather_pages(pool: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each sequence's cache as a contiguous copy: pool [n_slots, Hkv, D] ->
    [B, max_blocks * block_size, Hkv, D] (a reference's way in, not a kernel's)."""
    B, max_blocks = block_tables.shape
    positions = torch.arange(max_blocks * block_size, device=pool.device).expand(B, -1)
    return pool[pool_rows(block_tables, positions, block_size)]
