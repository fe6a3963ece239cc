"""The paged KV layout: one pool of KV blocks per layer and device, shared by every sequence.

k_pool and v_pool are [n_slots, Hkv, D] with n_slots = n_blocks * block_size (block_size a
power of two). A sequence's cache is a list of block ids: `block_tables` [B, max_blocks]
int32, row b sequence b's ids (padded with any valid id). Position p of sequence b lives at
pool row block_tables[b, p // block_size] * block_size + p % block_size, so a sequence
reaches max_blocks * block_size positions.

The kernels that read and write this layout (`decode_attention`, `attn_input`) share the
checks here; the torch references share the gathers.

A pool may have a second tier (`HostPages`): blocks whose ids are `first_block` and above live
in other tensors of the same row layout, typically page-locked host RAM that the GPU reads in
place over PCIe (a long context's older blocks). Block id b >= first_block is row
(b - first_block) * block_size + offset of the tier's tensors. Only reads go there
(`decode_attention`, the gathers); the rows a step writes are in the first tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostPages:
    """One layer's second tier of KV blocks: k, v [n_host_slots, Hkv, D] in the pool's row
    layout (same dtype and row strides), the int8 scales [n_host_slots, Hkv] where the pool
    has them, and the first block id that lives here."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    first_block: int

    def check(self, k_pool: torch.Tensor, k_scale: torch.Tensor | None) -> None:
        """The tier matches the pool it extends (dtype, row layout, scales, device)."""
        for name, t, like in (("k", self.k, k_pool), ("v", self.v, k_pool),
                              ("k_scale", self.k_scale, k_scale),
                              ("v_scale", self.v_scale, k_scale)):  # fmt: skip
            if (t is None) != (like is None):
                raise ValueError(f"the host tier's {name} and the pool's disagree (int8 scales"
                                 " in both or neither)")  # fmt: skip
            if t is None or like is None:
                continue
            if t.dtype != like.dtype or t.shape[1:] != like.shape[1:] or (
                t.stride() != like.stride()
            ):
                raise ValueError(
                    f"the host tier's {name} {t.dtype} {tuple(t.shape)} strides {t.stride()} is"
                    f" not in the pool's layout {like.dtype} {tuple(like.shape)} strides"
                    f" {like.stride()}"
                )
            if t.device != like.device:
                raise ValueError(f"the host tier's {name} is on {t.device}, the pool on"
                                 f" {like.device} (map its RAM for the device)")  # fmt: skip
        if self.k.shape[0] != self.v.shape[0]:
            raise ValueError("the host tier's k and v differ in rows")
        if self.first_block < 1:
            raise ValueError(f"first_block {self.first_block} leaves the pool no block")


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


def gather_rows(
    pool: torch.Tensor, rows: torch.Tensor, block_size: int, host: torch.Tensor | None,
    first_block: int,
) -> torch.Tensor:
    """pool[rows] for pool rows of any shape, those of blocks `first_block` and above read
    from the second tier `host` (rows - first_block * block_size) when it is given."""
    if host is None:
        return pool[rows]
    split = first_block * block_size
    on_host = rows >= split
    out = pool[torch.where(on_host, 0, rows)]
    out[on_host] = host[rows[on_host] - split].to(out.device)
    return out


def gather_pages(
    pool: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    host: torch.Tensor | None = None, first_block: int = 0,
) -> torch.Tensor:
    """Each sequence's cache as a contiguous copy: pool [n_slots, ...] ->
    [B, max_blocks * block_size, ...] (a reference's way in, not a kernel's); blocks
    `first_block` and above from the second tier `host` where given (`HostPages`)."""
    B, max_blocks = block_tables.shape
    positions = torch.arange(max_blocks * block_size, device=pool.device).expand(B, -1)
    rows = pool_rows(block_tables, positions, block_size)
    return gather_rows(pool, rows, block_size, host, first_block)
