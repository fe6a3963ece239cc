"""A resident window of KV (`engine.kv_resident`): a pool's second tier of blocks in host RAM,
where each cache's blocks before its newest `window` tokens go as it grows
(stratad/engine/kv.py), and the offload engine attending over both tiers
(kernels.layers.attention's host tier): the same tokens as with every block in the first."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kernels.layers.paged import HostPages
from kernels.tuning.configs import INTERPRETED
from stratad.config import Config, EngineConfig
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache, KVPool, pool_tokens, prompt_keys, resident_split
from stratad.engine.kv_format import FORMATS, KVFormat
from stratad.engine.offload.experts import blob_layouts
from stratad.engine.offload.forward import OffloadConfig, OffloadForward
from stratad.engine.placement import start_plan
from stratad.engine.reference.forward import ReferenceForward
from stratad.model.spec import Model


def _pool(blocks: int, host_blocks: int, window: int, bs: int = 8) -> KVPool:
    k = [torch.zeros(blocks * bs, 1, 2) for _ in range(2)]
    host = [HostPages(torch.zeros(host_blocks * bs, 1, 2), torch.zeros(host_blocks * bs, 1, 2),
                      None, None, blocks) for _ in range(2)]  # fmt: skip
    return KVPool(k, [t.clone() for t in k], bs, host=host, window=window)


def _write(cache: KVCache, tokens: list[int]) -> None:
    """What a forward does: the new rows (always in the first tier) hold the tokens."""
    cache.reserve(cache.length + len(tokens))
    rows = cache.rows(cache.length, cache.length + len(tokens), torch.device("cpu"))
    assert int(rows.max()) < cache.pool.n_blocks * cache.block_size  # never a host row
    for t in (*cache.k, *cache.v):
        t[rows] = torch.tensor(tokens, dtype=t.dtype)[:, None, None]
    cache.length += len(tokens)
    cache.tokens.extend(tokens)


def _read(cache: KVCache) -> list[int]:
    keys, values = cache.gather(1, cache.length, torch.device("cpu"))
    assert torch.equal(keys, values)
    return [int(x) for x in keys[:, 0, 0]]


def test_blocks_before_the_window_move_to_the_host_tier() -> None:
    """Blocks of 8, a window of 16: as the cache grows, every written block wholly before its
    newest 16 tokens moves (its rows copied, the table rewritten, the first tier's block
    free again), the block being filled never; reading through both tiers gives every
    token back; truncating gives host blocks back to the host tier."""
    pool = _pool(blocks=5, host_blocks=6, window=16)
    cache = KVCache(pool, 80)
    _write(cache, list(range(30)))  # blocks 0-3; nothing written lay before 30 - 16 yet
    assert not any(pool.on_host(b) for b in cache.blocks)
    assert cache.blocks_to_add(1) == 0  # room in block 3
    assert cache.blocks_to_add(3) == 0  # block 4 wanted, block 0 leaves: a net of none
    _write(cache, list(range(30, 41)))  # 41 - 16 = 25: blocks 0-2 (to 24) leave
    assert [pool.on_host(b) for b in cache.blocks] == [True] * 3 + [False] * 3
    assert pool.free_blocks == 5 - 3 and pool.free_host_blocks == 6 - 3
    assert _read(cache) == list(range(41))
    assert cache.table(torch.device("cpu")).tolist()[:6] == cache.blocks
    assert cache.own_blocks() == 3  # the first tier's, which releasing would give back
    # a reserve moves what was written before it: blocks 3 and 4 (to 40), not 5 (to 48)
    _write(cache, list(range(41, 72)))
    assert [pool.on_host(b) for b in cache.blocks] == [True] * 5 + [False] * 4
    # the host tier full: block 6 stays in the first tier (and its successor is wanted there)
    _write(cache, [72])  # 73 - 16 = 57: blocks 5 and 6 would leave, the tier takes one
    assert [pool.on_host(b) for b in cache.blocks] == [True] * 6 + [False] * 4
    assert pool.free_host_blocks == 0 and _read(cache) == list(range(73))
    assert cache.blocks_to_add(8) == 1
    cache.truncate(20)
    assert pool.free_host_blocks == 6 - 3 and _read(cache) == list(range(20))
    cache.release()
    assert pool.free_blocks == 5 and pool.free_host_blocks == 6 and not any(pool.refs)


def test_a_moved_block_stays_a_prefix_hit_and_a_shared_one_stays_put() -> None:
    """A registered block keeps its key as it moves (a new request reuses it from the host
    tier); a block another cache holds does not move (its id is in both tables)."""
    pool = _pool(blocks=6, host_blocks=6, window=16)
    a = KVCache(pool, 64)
    _write(a, list(range(24)))
    a.seal("s")
    keys = prompt_keys(list(range(24)), "s", 8)
    b = KVCache(pool, 64)
    b.adopt(pool.lookup(keys[:1]), keys[:1], list(range(8)))  # shares a's block 0
    _write(a, list(range(24, 40)))  # 40 - 16 = 24: blocks 0-2 leave, but 0 is shared
    assert [pool.on_host(x) for x in a.blocks[:3]] == [False, True, True]
    assert b.blocks[0] == a.blocks[0]
    assert pool.lookup(keys) == a.blocks[:3]  # the moved blocks' keys point at their new ids
    c = KVCache(pool, 64)
    c.adopt(pool.lookup(keys), keys, list(range(24)))
    assert _read(c) == list(range(24))


def test_resident_split_sizes_the_tiers() -> None:
    """Two caches of 1,024 with a window of 256 and chunks of 128: each window and two
    blocks, plus a chunk, in the first tier; the rest of each in the host tier."""
    assert resident_split(2048, 1024, 256, 128, 32) == (2 * (256 + 64) + 128, 2 * 768)
    assert resident_split(2048, 1024, 0, 128, 32) == (2048, 0)
    assert resident_split(2048, 1024, 1024, 128, 32) == (2048, 0)
    assert resident_split(1024, 1024, 900, 512, 32) == (1024, 124)  # capped at the whole
    with pytest.raises(ValueError, match="less than two blocks"):
        _pool(blocks=2, host_blocks=2, window=8)


def test_the_start_plan_counts_the_window_in_vram_and_the_rest_in_ram(
    tiny_moe_model: Model,
) -> None:
    """engine.kv_resident: the offload engine's VRAM counts the window's KV, the host's
    reserves the rest, page-locked; the setting is refused below two blocks."""

    def plan(resident: int):  # type: ignore[no-untyped-def]
        engine = msgspec.structs.replace(Config().engine, backend="offload", kv_resident=resident)
        cfg = msgspec.structs.replace(Config(), engine=engine)
        return start_plan(cfg, tiny_moe_model, torch.device("cpu"), free_vram=None,
                          source_slot_bytes=1)  # fmt: skip

    whole, window = plan(0), plan(64)
    assert not [r for r in whole.reserves if r[0].startswith("KV blocks")]
    (label, ram), = [r for r in window.reserves if r[0].startswith("KV blocks")]
    assert "engine.kv_resident" in label and ram > 0
    with pytest.raises(ValueError, match="less than two KV blocks"):
        EngineConfig(kv_resident=32)


def _engine(model: Model, device: str, window: int, fmt: KVFormat, **kw) -> OffloadForward:  # type: ignore[no-untyped-def]
    budget = 3 * model.spec.n_layers * blob_layouts(model).slot_bytes
    cfg = OffloadConfig(expert_vram_bytes=budget, dtype=torch.float32, max_context=256,
                        kv_format=fmt, kv_resident=window, **kw)  # fmt: skip
    return OffloadForward(model, torch.device(device), cfg)


def _greedy(forward, cache: KVCache, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    logits = forward.step([Seq(cache, prompt)])
    out = [int(logits[0][-1].argmax())]
    for _ in range(n - 1):
        out.append(int(forward.step([Seq(cache, [out[-1]])])[0][-1].argmax()))
    return out


@pytest.mark.parametrize("name", ["plain", "int8", "q4"])
def test_offload_tokens_with_a_window_equal_the_reference_cpu(
    tiny_moe_model: Model, name: str
) -> None:
    """Blocks of 8, a window of 16: a 40-token prompt in chunks of 16, then 3 decodes. The
    first blocks go to the host tier as the cache grows (the later chunks gather them from
    there, the decodes' kernel reads them there), and the greedy tokens are the reference's
    (over keys and values rounded as the pool stores them: int8, or 4-bit codes the kernel
    dequantizes in registers), which keeps every position in one cache."""
    fmt = FORMATS[name]
    ref = ReferenceForward(tiny_moe_model, kv_format=fmt)
    want = _greedy(ref, ref.new_cache(64), PROMPT[:40], 4)
    engine = _engine(tiny_moe_model, "cpu", 16, fmt, kernels=INTERPRETED, graphs=False,
                     prefill_chunk=16, row_tokens=1)  # fmt: skip
    pool = KVPool.allocate(tiny_moe_model.spec, 48, [torch.device("cpu")] * 4, torch.float32,
                           block_size=8, fmt=fmt, window=16, host_tokens=32)  # fmt: skip
    cache = KVCache(pool, 64)
    assert _greedy(engine, cache, PROMPT[:40], 4) == want
    assert [pool.on_host(b) for b in cache.blocks] == [True] * 3 + [False] * 3


PROMPT = [(7 * i) % 200 + 3 for i in range(100)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["plain", "int8", "q4"])
def test_offload_tokens_with_a_window_equal_all_resident_gpu(
    tiny_moe_model: Model, name: str
) -> None:
    """On the GPU, the engine's own pools (blocks of 32, a window of 64, chunks of 32): the
    host tier is page-locked RAM mapped for the device (the kernels and the chunks' gathers
    read it over PCIe), the decode steps captured graphs; the tokens are those of every
    block in VRAM."""

    def run(window: int) -> tuple[list[int], KVPool]:
        engine = _engine(tiny_moe_model, "cuda", window, FORMATS[name], prefill_chunk=32)
        pool = engine.new_pool(pool_tokens(1, 256))
        return _greedy(engine, KVCache(pool, 256), PROMPT, 4), pool

    (want, _), (got, pool) = run(0), run(64)
    assert pool.n_blocks == (64 + 64 + 32) // 32 and pool.n_host_blocks == (256 - 64) // 32
    assert pool.host[0].k.device.type == "cuda" and pool.free_host_blocks == 6 - 1
    assert got == want
