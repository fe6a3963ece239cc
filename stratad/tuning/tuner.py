"""Measure candidate launch settings of the offload engine's kernels on this GPU and keep the
fastest that give the default's result (`stratactl tune` writes them as a tuning table).

Each kernel runs at a model's decode shapes (one token, top-k experts, a 1K context in a 4K
cache, a layer's projections over copies that outgrow L2) and prefill's dequantization shape,
timed in a CUDA graph as decode runs it. The default settings run first: their output is
the reference every candidate must match (bit for bit where the kernel only moves or
converts bytes; within rounding where the summation order changes), and a candidate
replaces the default only if it is clearly faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch

from kernels.experts.expert_fetch import FetchConfig, fetch_experts
from kernels.experts.moe import MoeConfig, fused_moe
from kernels.formats.dequant import DequantConfig, dequant_q4_0_split
from kernels.layers.attention import AttentionConfig, attention_counts, decode_attention
from kernels.layers.linear import LinearConfig, decode_linear
from kernels.tuning.configs import TUNED, KernelConfigs
from stratad.engine.offload.kernel_table import Shapes

Progress = Callable[[str], None]


def candidates(default: KernelConfigs) -> dict[str, list[Any]]:
    """The settings tried per kernel, the default first."""
    moe = [MoeConfig(block_n=n, block_b=b, num_warps=w)
           for n in (8, 16, 32) for b in (8, 16, 32) for w in (2, 4, 8)]  # fmt: skip
    fetch = [FetchConfig(chunk=c << 10, block=b, num_warps=w)
             for c in (32, 64, 128) for b in (1024, 2048) for w in (4, 8)]  # fmt: skip
    attention = [AttentionConfig(block_s=b, split_s=s, max_splits=m, num_warps=w)
                 for b in (16, 32, 64) for s in (32, 64, 128) for m in (16, 32, 64)
                 for w in (4, 8) if s % b == 0]  # fmt: skip
    dequant = [DequantConfig(block_r=r, block_b=b, num_warps=w)
               for r in (8, 16, 32) for b in (4, 8) for w in (4, 8)]  # fmt: skip
    linear = [LinearConfig(block_n=n, block_k=k, num_warps=w)
              for n in (1, 2, 4, 8) for k in (256, 512, 1024, 2048) for w in (2, 4, 8)]  # fmt: skip
    found: dict[str, list[Any]] = {"moe": moe, "fetch": fetch, "attention": attention,
                                   "dequant": dequant, "linear": linear}  # fmt: skip
    return {k: [getattr(default, k)] + [c for c in v if c != getattr(default, k)]
            for k, v in found.items()}  # fmt: skip


def _time_us(run: Callable[[], object], device: torch.device, budget_ms: int) -> float:
    """Microseconds per call. On the GPU the calls are captured in a CUDA/HIP graph and
    replayed, as the engine's decode step runs them: timed from Python, a launch's own
    overhead (tens of microseconds) would outweigh the kernel and rank settings at random."""
    if device.type != "cuda":  # the interpreter (tests): one timed run is all it can afford
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing

    ms = triton.testing.do_bench_cudagraph(run, rep=budget_ms, return_mode="median")
    return float(ms) * 1e3


def _pick(times: list[tuple[float, Any]], margin: float) -> tuple[float, Any]:
    """The fastest setting, but the default (first) stays unless another beats it by more than
    `margin` (a share): a difference inside the machine's noise is no reason to change."""
    us, cfg = min(times, key=lambda t: t[0])
    return (us, cfg) if us < (1 - margin) * times[0][0] else times[0]


def _cold_projections(
    s: Shapes, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> list[tuple[torch.Tensor, ...]]:
    """A layer's decode projections (qkv, o, router), in copies that together outgrow the
    GPU's L2 three times over: decode reads each layer's weights once per step, from HBM,
    and a kernel timed on one weight replayed from L2 ranks settings by a rate decode never
    sees."""
    q_dim = s.n_heads * s.head_dim
    shapes = ((s.qkv_rows, s.hidden), (s.hidden, q_dim), (s.n_experts, s.hidden))
    layer = tuple((torch.randn(r, c, generator=gen) / c**0.5).to(device, dtype) for r, c in shapes)
    if device.type != "cuda":
        return [layer]
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    size = sum(w.numel() * w.element_size() for w in layer)
    n = min(64, max(2, -(-3 * l2 // size)))
    return [layer] + [tuple(w.clone() for w in layer) for _ in range(n - 1)]


def _q4_0_blobs(n: int, s: Shapes, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[n, blob bytes] split-Q4_0 experts (gate | up | down) with finite scales."""
    blob = 3 * s.gate_bytes
    data = torch.randint(0, 256, (n, blob), dtype=torch.uint8, generator=gen)
    gate, down = (s.ffn, s.hidden), (s.hidden, s.ffn)
    for lo, (rows, cols) in ((0, gate), (s.gate_bytes, gate), (2 * s.gate_bytes, down)):
        nscales = rows * (cols // 32)
        scales = (torch.rand(n, nscales, generator=gen) * 0.02).to(torch.float16)
        data[:, lo : lo + 2 * nscales] = scales.view(torch.uint8)
    return data.to(device)


def _benches(
    s: Shapes, device: torch.device, dtype: torch.dtype
) -> dict[str, tuple[Callable[[Any], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], bool]]]:
    """Per kernel: (run(config) -> result, results_match(a, b))."""
    gen = torch.Generator().manual_seed(0)
    k, gb = s.top_k, s.gate_bytes
    vram = _q4_0_blobs(2 * k, s, device, gen)
    host = _q4_0_blobs(2 * k, s, torch.device("cpu"), gen)
    if device.type == "cuda":
        host = host.pin_memory()

    def table(blobs: torch.Tensor) -> torch.Tensor:
        base = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64)
        return torch.stack([base, base + gb, base + 2 * gb], dim=1).to(device)

    x = torch.randn(1, s.hidden, generator=gen).to(device, dtype)
    ids = torch.arange(k, dtype=torch.int32, device=device)[None]
    weights = torch.full((1, k), 1.0 / k, device=device)
    vtable, htable = table(vram), table(host)
    span = (host.data_ptr(), host.data_ptr() + host.numel())
    staging = torch.empty((k, 3 * gb), dtype=torch.uint8, device=device)
    q = torch.randn(1, s.n_heads, s.head_dim, generator=gen).to(device, dtype)
    kv = torch.randn(2, 1, s.cache, s.n_kv_heads, s.head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor([s.context], device=device)
    counts = attention_counts(1, s.n_kv_heads, device)
    layers = _cold_projections(s, device, dtype, gen)
    attn_out = torch.randn(1, s.n_heads * s.head_dim, generator=gen).to(device, dtype)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a.float() - b.float()).norm() <= 1e-2 * b.float().norm())

    # the tables hold raw addresses: these defaults keep the blobs alive with the closures
    def fetch(cfg: FetchConfig, _blobs: object = host) -> torch.Tensor:
        fetch_experts(ids, htable, span, staging, 3 * gb, cfg)
        return staging.clone()

    def projections(cfg: LinearConfig) -> torch.Tensor:
        """Every copy's qkv, o and router in turn; the last copy's outputs."""
        for qkv, o, router in layers:
            outs = (decode_linear(x, qkv, config=cfg), decode_linear(attn_out, o, config=cfg),
                    decode_linear(x, router, config=cfg))  # fmt: skip
        return torch.cat(outs, dim=1)

    def moe(cfg: MoeConfig, _blobs: object = vram) -> torch.Tensor:
        return fused_moe(x, ids, weights, vtable, s.ffn, cfg, aligned=gb % 16 == 0)

    return {
        "moe": (moe, close),
        "fetch": (fetch, torch.equal),
        "attention": (
            lambda cfg: decode_attention(q, kv[0], kv[1], lens, config=cfg, counts=counts),
            close,
        ),
        "dequant": (
            lambda cfg: dequant_q4_0_split(vram[:, :gb], s.ffn, s.hidden, dtype, config=cfg),
            torch.equal,
        ),
        "linear": (projections, close),
    }


def tune(
    shapes: Shapes,
    device: torch.device,
    kernels: Iterable[str] = TUNED,
    quick: bool = False,
    budget_ms: int = 20,  # of replays per candidate on the GPU
    progress: Progress = print,
    margin: float = 0.03,
) -> tuple[KernelConfigs, dict[str, dict[str, object]]]:
    """The fastest matching settings per kernel (the default unless one is more than
    `margin` faster), and what was measured (microseconds)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    best = KernelConfigs()
    benches = _benches(shapes, device, dtype)
    measured: dict[str, dict[str, object]] = {}
    for name, tried in candidates(best).items():
        if name not in kernels:
            continue
        tried = tried[:2] if quick else tried
        run, match = benches[name]
        want = run(tried[0])
        times: list[tuple[float, Any]] = []
        for n, cfg in enumerate(tried, 1):
            try:
                ok = match(run(cfg), want)
                us = _time_us(partial(run, cfg), device, budget_ms) if ok else float("inf")
            except Exception as err:  # a setting this compiler refuses (resources, layout)
                progress(f"{name} {n}/{len(tried)} {_fmt(cfg)}: refused ({err.__class__.__name__})")
                continue
            progress(f"{name} {n}/{len(tried)} {_fmt(cfg)}: "
                     + (f"{us:.1f} us" if ok else "wrong result, skipped"))  # fmt: skip
            times.append((us, cfg))
        if not times:  # nothing ran (not even the default): keep the default, say so
            progress(f"{name}: no setting ran; the table keeps the default")
            continue
        us, cfg = _pick(times, margin)
        best = replace(best, **{name: cfg})
        if name == "moe":  # timed as gate/up and down together: one setting for both
            best = replace(best, moe_down=cfg)
        default_us = times[0][0]
        measured[name] = {"default_us": round(default_us, 2), "best_us": round(us, 2),
                          "candidates": len(tried)}  # fmt: skip
        progress(f"{name}: {_fmt(cfg)} at {us:.1f} us (default {default_us:.1f} us)")
    return best, measured


def _fmt(cfg: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in asdict(cfg).items())
