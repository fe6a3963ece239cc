"""Expert fetch for decode: copy the step's missed experts from page-locked RAM into VRAM.

The second of the GPU's miss paths (the first is the fused MoE kernel reading host memory in
place, `kernels.experts.moe`). One launch per layer, with the routing still on the device:

  for every (token, slot) s routed to expert e = ids[s], f the first pair routed to e:
    - e's blob address (`table[e, 0]`, its gate matrix, which starts the blob) lies in the
      host range [host_lo, host_hi): the blob is copied once, by every program of row f in
      pieces of CHUNK bytes, into `staging[f]`, and `step_table[s]` points at the copy;
    - otherwise (a VRAM slot): `step_table[s]` is e's row of `table`, unchanged;
    - `slot_ids[s]` is f, so that the fused kernels still see which pairs share an expert
      (and read it once for all of them); e < 0 (computed elsewhere, the CPU miss path): -1.

`fused_moe(x, slot_ids, weights, step_table, ffn)` then reads every expert from VRAM. A batch
of tokens copies the union of its missed experts, each once. A copy
kernel with hundreds of programs each holding many wide loads in flight keeps the PCIe link
busy, which the compute kernel, with its dependent loads and arithmetic per block, does not.
The bytes that cross the link are the same as in place: the blob once per step.

Three tiers as everywhere in kernels/: the Triton body, the launcher `fetch_experts`, and the
torch reference `fetch_experts_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class FetchConfig:
    chunk: int = 64 * 1024  # bytes of one blob per program step
    block: int = 2048  # 32-bit words per load step (8 KiB)
    num_warps: int = 4
    # at most this many programs per blob, each copying every programs-th chunk: a copy that
    # overlaps compute on a stream of its own (engine.prefetch) leaves the SMs to the compute
    programs: int = 1024


@triton.jit
def _fetch_kernel(
    ids_ptr,  # [S] int: routed expert per (token, slot)
    table_ptr,  # [E, 3] int64 byte addresses (gate, up, down) of the layer's experts
    step_ptr,  # [S, 3] int64 out: the addresses this step's kernels read
    slot_ids_ptr,  # [S] int32 out: s, or -1 where ids[s] < 0
    stage_base,  # byte address of staging [S, stage_stride] uint8: copies of the missed blobs
    host_lo,
    host_hi,
    stage_stride,
    N16,  # blob bytes / 16
    N_CHUNKS,  # cdiv(blob bytes, chunk)
    N_PAIRS,
    CHUNK_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRS: tl.constexpr,  # a power of two >= N_PAIRS: the scan for a pair's first sharer
):
    s = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int64)
    s64 = s.to(tl.int64)
    if e >= 0:
        at = tl.arange(0, PAIRS)
        every = tl.load(ids_ptr + at, mask=at < N_PAIRS, other=-1)
        first = tl.min(tl.where((every == e) & (at < N_PAIRS), at, PAIRS))  # the first sharer
        gate = tl.load(table_ptr + e * 3)
        up = tl.load(table_ptr + e * 3 + 1)
        down = tl.load(table_ptr + e * 3 + 2)
        missed = (gate >= host_lo) & (gate < host_hi)
        if missed:
            base = stage_base + first.to(tl.int64) * stage_stride
            if c == 0:
                tl.store(step_ptr + s64 * 3, base)
                tl.store(step_ptr + s64 * 3 + 1, base + (up - gate))
                tl.store(step_ptr + s64 * 3 + 2, base + (down - gate))
            if first == s:  # the first sharer copies the blob, once for all of them
                # blobs and staging rows are 16-byte aligned (the launcher checks): say so, so that
                # each thread moves 16 bytes per load, not 4
                src_words = tl.multiple_of(gate.to(tl.pointer_type(tl.int32)), 16)
                dst_words = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
                for part in range(c, N_CHUNKS, tl.num_programs(1)):
                    lo = part * CHUNK_WORDS
                    for w0 in range(lo, lo + CHUNK_WORDS, BLOCK):
                        w = tl.multiple_of(w0, BLOCK) + tl.arange(0, BLOCK)
                        mask = w < N16 * 4  # whole 16-byte pieces: the loads stay 16 bytes wide
                        tl.store(dst_words + w, tl.load(src_words + w, mask=mask), mask=mask)
        elif c == 0:
            tl.store(step_ptr + s64 * 3, gate)
            tl.store(step_ptr + s64 * 3 + 1, up)
            tl.store(step_ptr + s64 * 3 + 2, down)
        if c == 0:
            tl.store(slot_ids_ptr + s, first.to(tl.int32))
    elif c == 0:
        tl.store(slot_ids_ptr + s, -1)


def fetch_experts(
    ids: torch.Tensor,
    table: torch.Tensor,
    host: tuple[int, int],
    staging: torch.Tensor,
    blob_bytes: int,
    config: FetchConfig = FetchConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the missed experts of one layer's step into `staging` [>= T*k, >= blob_bytes].

    ids [T, k] routed experts (negative: skipped), table [E, 3] the layer's addresses, host the
    byte range [lo, hi) of the page-locked expert copy. Returns (slot_ids [T, k] int32,
    step_table [T*k, 3] int64) for `kernels.experts.moe.fused_moe`."""
    if ids.dim() != 2 or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [T, k], got {tuple(ids.shape)}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"table must be int64 [E, 3], got {table.dtype} {tuple(table.shape)}")
    n = ids.numel()
    if staging.dtype != torch.uint8 or staging.dim() != 2 or staging.stride(1) != 1:
        raise ValueError("staging must be a uint8 [slots, bytes] buffer with contiguous rows")
    if staging.shape[0] < n or staging.shape[1] < blob_bytes:
        raise ValueError(
            f"staging {tuple(staging.shape)} is smaller than {n} blobs of {blob_bytes} bytes"
        )
    if blob_bytes % 16 or staging.stride(0) % 16 or staging.data_ptr() % 16:
        raise ValueError("blobs and staging rows must be 16-byte multiples and aligned")
    if not (ids.device == table.device == staging.device):
        raise ValueError("ids, table and staging must be on one device")
    if config.chunk % (4 * config.block):
        raise ValueError(f"chunk {config.chunk} is not a multiple of {4 * config.block} bytes")
    step = torch.empty((n, 3), dtype=torch.int64, device=ids.device)
    slot_ids = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    if n == 0:
        return slot_ids, step
    chunks = triton.cdiv(blob_bytes, config.chunk)
    grid = (n, min(chunks, config.programs))
    _fetch_kernel[grid](
        ids, table, step, slot_ids, staging.data_ptr(), host[0], host[1], staging.stride(0),
        blob_bytes // 16, chunks, n, CHUNK_WORDS=config.chunk // 4, BLOCK=config.block,
        PAIRS=triton.next_power_of_2(n), num_warps=config.num_warps,
    )  # fmt: skip
    return slot_ids, step


def fetch_experts_ref(
    ids: torch.Tensor, table: torch.Tensor, host: tuple[int, int], staging_base: int, stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `fetch_experts` returns (the addresses; the copies are checked by their bytes)."""
    flat = ids.reshape(-1).tolist()
    rows = table.cpu().tolist()
    step: list[list[int] | None] = []
    for e in flat:
        if e < 0:
            step.append(None)
            continue
        gate, up, down = rows[e]
        if host[0] <= gate < host[1]:
            base = staging_base + flat.index(e) * stride
            step.append([base, base + up - gate, base + down - gate])
        else:
            step.append([gate, up, down])
    slot_ids = torch.tensor([flat.index(e) if e >= 0 else -1 for e in flat], dtype=torch.int32)
    return slot_ids.view(ids.shape), torch.tensor(
        [r if r is not None else [0, 0, 0] for r in step], dtype=torch.int64
    )
