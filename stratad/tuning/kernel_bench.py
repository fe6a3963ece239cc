"""Every kernel the offload engine launches, timed at a model's shapes (`stratactl bench kernels`).

Decode (one token): the dense projections (`kernels.layers.linear`, the output head included), the
RMS norm and the residual add fused with it, the attention input (q/k norms, RoPE, KV write), decode
attention over a `context`-position cache, the router's top-k, the fused MoE's two launches for each
GGUF type mix the model's experts hold, and the copy of k missed experts from page-locked RAM
(`kernels.experts.expert_fetch`). Prefill (a chunk of `prefill` tokens): the projections as torch
GEMMs, the norms, RoPE, torch's attention, the router, each expert projection's dequantization for a
whole layer (`kernels.formats.dequant` / `kernels.formats.dequant_blocks`) and the grouped GEMMs
over it (`stratad.engine.offload.grouped`). Each case says the bytes it must move and the FLOPs it
must do; `kernels.tuning.roofline` holds them to the device's ceilings. The dense weights are
dequantized once at load (`stratad.engine.offload.dense`): whatever type the file stores them in,
decode's projections run in the compute dtype, and are timed so.

The weights are random, laid out as the engine keeps them (`stratad.tuning.bench_weights`).
A decode case whose weights would fit in L2 cycles through copies (distinct experts, copies
of the projections) that outgrow it, as decode reads every layer from memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as fn
from torch.nn.attention.bias import causal_lower_right

from kernels.experts.expert_fetch import fetch_experts
from kernels.experts.moe import ExpertFormat, moe_down, moe_gate_up
from kernels.experts.router import route_topk
from kernels.formats.dequant import DequantConfig, dequant_q4_0_split
from kernels.formats.dequant_blocks import dequant_blocks
from kernels.formats.quant import QType
from kernels.layers.attention import attention_counts, decode_attention
from kernels.layers.attn_input import attn_input
from kernels.layers.linear import LinearConfig, decode_linear
from kernels.layers.norm import add_rmsnorm, rmsnorm
from kernels.layers.rope import RopeStyle, rope_table
from kernels.tuning.configs import INTERPRETED, KernelConfigs
from kernels.tuning.roofline import Row, time_us
from stratad.engine.offload.grouped import grouped_glu
from stratad.model.spec import Model, ModelSpec
from stratad.tuning.bench_weights import ExpertLayer, Mix, expert_layers

GROUPS = ("linear", "norm", "rope", "attention", "router", "moe", "fetch", "dequant", "grouped")
# the interpreter runs a program as numpy operations: fewer, wider programs finish sooner
# (the engine on a CPU runs its dense projections and dequantization in torch anyway)
INTERPRETED_BENCH = replace(INTERPRETED, linear=LinearConfig(block_n=128, block_k=256),
                            dequant=DequantConfig(block_r=128))  # fmt: skip


@dataclass(frozen=True)
class BenchShapes:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int  # one expert's
    n_experts: int
    top_k: int
    vocab: int
    qk_norm: bool  # per-head q/k norms
    mixes: tuple[Mix, ...] = ((QType.Q4_0,) * 3,)  # each (gate, up, down) the experts hold
    context: int = 1024  # decode's cached positions
    cache: int = 4096  # the daemon's default max_context
    prefill: int = 4096  # the daemon's default prefill chunk
    staged: int = 0  # experts a prefill layer dequantizes (0: every one, as prefill does)
    rope_style: RopeStyle = RopeStyle.NEOX
    norm_topk: bool = True  # the router renormalises its top-k weights

    @classmethod
    def of(cls, spec: ModelSpec, mixes: tuple[Mix, ...]) -> BenchShapes:
        style = RopeStyle.INTERLEAVED if spec.rope_interleaved else RopeStyle.NEOX
        return cls(spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.expert_ffn,
                   spec.n_experts, spec.n_experts_used, spec.vocab_size, spec.qk_norm == "head",
                   mixes, rope_style=style, norm_topk=spec.norm_topk_prob)  # fmt: skip

    @property
    def qkv_rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def describe(self) -> str:
        mixes = ", ".join("/".join(q.name for q in m) for m in self.mixes)
        return (f"hidden {self.hidden}, {self.n_heads}/{self.n_kv_heads} heads of"
                f" {self.head_dim}, {self.n_experts} experts of {self.ffn} (top-{self.top_k},"
                f" {mixes}), vocab {self.vocab}, context {self.context}, prefill {self.prefill}"
                f" tokens over {self.staged or self.n_experts} experts")  # fmt: skip


def expert_mixes(model: Model) -> tuple[Mix, ...]:
    """Each distinct (gate, up, down) type of the model's routed experts, in layer order."""
    found: list[Mix] = []
    for i in range(model.spec.n_layers):
        name = f"model.layers.{i}.mlp.experts.%s_proj"
        mix = tuple(model.tensor(name % p).qtype for p in ("gate", "up", "down"))
        if mix not in found:
            found.append(mix)  # type: ignore[arg-type]
    return tuple(found)


@dataclass(frozen=True)
class Case:
    group: str
    phase: str
    kernel: str
    shape: str
    run: Callable[[], object]
    nbytes: int = 0
    flops: int = 0
    link: str = "d2d"
    calls: int = 1  # kernel calls per run (copies cycled to outgrow L2)
    dtype: str = ""  # the matmul rate its FLOPs are held to ("": the compute dtype)
    graph: bool = True  # timed in a CUDA graph (False: the call may sync with the host)


def _cycle(n_bytes: int, device: torch.device) -> int:
    """How many copies of `n_bytes` outgrow the GPU's L2 three times over (at most 16)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(16, -(-3 * l2 // max(n_bytes, 1))))


def cases(
    s: BenchShapes,
    device: torch.device,
    dtype: torch.dtype,
    cfg: KernelConfigs,
    groups: tuple[str, ...] = GROUPS,
) -> Iterator[Case]:
    """The cases of `groups` in the order they run, built a few at a time (their buffers
    go when the next are built)."""
    wanted = set(groups)
    if wanted & {"linear", "norm", "rope", "attention", "router"}:
        yield from _decode_dense(s, device, dtype, cfg)
    if wanted & {"moe", "fetch"}:
        yield from _decode_experts(s, device, dtype, cfg)
    yield from _prefill(s, device, dtype, cfg, experts=bool(wanted & {"dequant", "grouped"}))


def _decode_dense(
    s: BenchShapes, device: torch.device, dtype: torch.dtype, cfg: KernelConfigs
) -> Iterator[Case]:
    e, h, dn = dtype.itemsize, s.hidden, str(dtype).removeprefix("torch.")
    x = torch.randn(1, h, device=device, dtype=dtype)
    attn_out = torch.randn(1, s.n_heads * s.head_dim, device=device, dtype=dtype)
    projections = (("qkv", s.qkv_rows, h, x), ("o", h, s.n_heads * s.head_dim, attn_out),
                   ("router", s.n_experts, h, x), ("head", s.vocab, h, x))  # fmt: skip
    for name, rows, cols, inp in projections:
        n = _cycle(rows * cols * e, device)
        ws = [torch.randn(rows, cols, device=device, dtype=dtype) / cols**0.5 for _ in range(n)]

        def run(ws: list[torch.Tensor] = ws, inp: torch.Tensor = inp) -> None:
            for w in ws:
                decode_linear(inp, w, None, cfg.linear)

        nbytes = (rows * cols + rows + cols) * e
        yield Case("linear", "decode", f"linear {name}", f"[{rows}, {cols}] {dn}", run, nbytes,
                   2 * rows * cols, calls=n, dtype=dn)  # fmt: skip
    w = torch.ones(h, device=device, dtype=dtype)
    yield Case("norm", "decode", "rmsnorm", f"[1, {h}]", lambda: rmsnorm(x, w, 1e-6), 4 * h * e)
    parts = torch.randn(1, s.top_k, h, device=device)
    yield Case("norm", "decode", "add_rmsnorm (+k parts)", f"[1, {s.top_k}, {h}]",
               lambda: add_rmsnorm(x, parts, w, 1e-6), 4 * h * e + parts.numel() * 4)  # fmt: skip
    kv = torch.randn(2, s.cache, s.n_kv_heads, s.head_dim, device=device, dtype=dtype)
    qkv = torch.randn(1, s.qkv_rows, device=device, dtype=dtype)
    pos = torch.tensor([s.context - 1], device=device)
    cos = torch.rand(s.cache, s.head_dim // 2, device=device)
    sin = torch.rand(s.cache, s.head_dim // 2, device=device)
    norms = (torch.ones(s.head_dim, device=device, dtype=dtype),) * 2 if s.qk_norm else None

    def rope() -> None:
        attn_input(qkv, pos, norms, cos, sin, kv[0], kv[1], s.rope_style, 1e-6)  # type: ignore[arg-type]

    yield Case("rope", "decode", "attn_input (norms+RoPE+KV)", f"[1, {s.qkv_rows}]", rope,
               2 * s.qkv_rows * e + 2 * s.head_dim * 4)  # fmt: skip
    q = torch.randn(1, s.n_heads, s.head_dim, device=device, dtype=dtype)
    lens = torch.tensor([s.context], device=device)
    counts = attention_counts(1, s.n_kv_heads, device)
    yield Case("attention", "decode", "decode_attention", f"ctx {s.context} of {s.cache}",
               lambda: decode_attention(q, kv[0][None], kv[1][None], lens, config=cfg.attention,
                                        counts=counts),
               2 * s.context * s.n_kv_heads * s.head_dim * e + 2 * q.numel() * e,
               4 * s.context * s.n_heads * s.head_dim, dtype=dn)  # fmt: skip
    logits = torch.randn(1, s.n_experts, device=device, dtype=dtype)
    yield Case("router", "decode", "route_topk", f"[1, {s.n_experts}] top-{s.top_k}",
               lambda: route_topk(logits, s.top_k, s.norm_topk),
               s.n_experts * e + 8 * s.top_k)  # fmt: skip


def _decode_experts(
    s: BenchShapes, device: torch.device, dtype: torch.dtype, cfg: KernelConfigs
) -> Iterator[Case]:
    """The fused MoE's gate/up launch for each (gate, up) type pair the experts hold, its down
    launch for each down type, and the expert fetch."""
    h, k, f = s.hidden, s.top_k, s.ffn
    x = torch.randn(1, h, device=device, dtype=dtype)
    weights = torch.full((1, k), 1.0 / k, device=device)
    mixes: list[Mix] = []  # the first mix to hold each (gate, up) pair and each down type
    for m in s.mixes:
        if m[:2] not in {n[:2] for n in mixes} or m[2] not in {n[2] for n in mixes}:
            mixes.append(m)
    timed: set[tuple[QType, ...]] = set()  # gate/up pairs, (down,)
    sizes = None
    for layer in expert_layers(tuple(mixes), s.hidden, s.ffn, s.n_experts, device):
        g, u, d = sizes = layer.expert_bytes()
        # distinct experts per call, as many sets as the layer holds (all of them cycled)
        sets = max(1, min(s.n_experts // k, _cycle(k * (g + u + d), device)))
        order = torch.randperm(s.n_experts, device=device).to(torch.int32)
        ids = [order[i * k : (i + 1) * k][None].contiguous() for i in range(sets)]
        fmt, al = ExpertFormat(*layer.mix), layer.aligned
        acts = [torch.randn(k, f, device=device) for _ in ids]  # the down kernel's input

        def gate_up(layer: ExpertLayer = layer, ids: list[torch.Tensor] = ids,
                    fmt: ExpertFormat = fmt, al: bool = al) -> None:  # fmt: skip
            for i in ids:
                moe_gate_up(x, i, layer.table, f, cfg.moe_for("moe", fmt.gate), al, fmt)

        def down(layer: ExpertLayer = layer, ids: list[torch.Tensor] = ids,
                 acts: list[torch.Tensor] = acts, fmt: ExpertFormat = fmt,
                 al: bool = al) -> None:  # fmt: skip
            for i, a in zip(ids, acts, strict=True):
                moe_down(a, i, weights, layer.table, h, cfg.moe_for("moe_down", fmt.down), al,
                         fmt)  # fmt: skip

        gate, up, dn = layer.mix
        if (gate, up) not in timed:
            timed.add((gate, up))
            name = gate.name if gate == up else f"{gate.name}/{up.name}"
            shape = f"{k} of {s.n_experts} x [{f}, {h}]"
            yield Case("moe", "decode", f"moe_gate_up {name}", shape, gate_up,
                       k * (g + u) + h * 2 + k * f * 4, 4 * k * f * h, calls=sets)  # fmt: skip
        if (dn,) not in timed:
            timed.add((dn,))
            yield Case("moe", "decode", f"moe_down {dn.name}", f"{k} of {s.n_experts} x [{h}, {f}]",
                       down, k * d + k * f * 4 + k * h * 4, 2 * k * f * h, calls=sets)  # fmt: skip
    if sizes is not None:
        yield _fetch_case(s, device, sizes, cfg)


def _fetch_case(s: BenchShapes, device: torch.device, sizes: tuple[int, ...],
                cfg: KernelConfigs) -> Case:  # fmt: skip
    """k experts' blobs copied from page-locked RAM into staging rows, as a decode miss is."""
    k, blob = s.top_k, -(-sum(sizes) // 16) * 16
    host = torch.randint(0, 256, (s.n_experts, blob), dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    base = host.data_ptr() + blob * torch.arange(s.n_experts, dtype=torch.int64)
    table = torch.stack([base, base + sizes[0], base + sizes[0] + sizes[1]], dim=1).to(device)
    span = (host.data_ptr(), host.data_ptr() + host.numel())
    staging = torch.empty((k, blob), dtype=torch.uint8, device=device)
    ids = torch.randperm(s.n_experts, device=device)[:k].to(torch.int32)[None].contiguous()

    def run(_host: torch.Tensor = host) -> None:  # the table holds raw addresses: keep it
        fetch_experts(ids, table, span, staging, blob, cfg.fetch)

    return Case("fetch", "decode", "fetch_experts (pinned RAM)", f"{k} x {blob:,} B", run,
                k * blob, link="h2d")  # fmt: skip


def _prefill(
    s: BenchShapes, device: torch.device, dtype: torch.dtype, cfg: KernelConfigs, experts: bool
) -> Iterator[Case]:
    t, h, e, dn = s.prefill, s.hidden, dtype.itemsize, str(dtype).removeprefix("torch.")
    x = torch.randn(t, h, device=device, dtype=dtype)
    attn_out = torch.randn(t, s.n_heads * s.head_dim, device=device, dtype=dtype)
    projections = (("qkv", s.qkv_rows, h, x), ("o", h, s.n_heads * s.head_dim, attn_out),
                   ("router", s.n_experts, h, x))  # fmt: skip
    for name, rows, cols, inp in projections:
        w = torch.randn(rows, cols, device=device, dtype=dtype) / cols**0.5
        nbytes = (rows * cols + t * (rows + cols)) * e
        yield Case("linear", "prefill", f"linear {name} (torch GEMM)", f"{t} x [{rows}, {cols}]",
                   lambda w=w, inp=inp: fn.linear(inp, w),  # type: ignore[misc]
                   nbytes, 2 * t * rows * cols, dtype=dn)  # fmt: skip
    w = torch.ones(h, device=device, dtype=dtype)
    yield Case("norm", "prefill", "rmsnorm", f"[{t}, {h}]", lambda: rmsnorm(x, w, 1e-6),
               (2 * t + 1) * h * e)  # fmt: skip
    parts = torch.randn(t, 1, h, device=device, dtype=dtype)
    yield Case("norm", "prefill", "add_rmsnorm", f"[{t}, 1, {h}]",
               lambda: add_rmsnorm(x, parts, w, 1e-6), (4 * t + 1) * h * e)  # fmt: skip
    pos = torch.arange(t, device=device)
    cos = torch.rand(t, s.head_dim // 2, device=device)
    sin = torch.rand(t, s.head_dim // 2, device=device)
    q = torch.randn(t, s.n_heads, s.head_dim, device=device, dtype=dtype)
    k = torch.randn(t, s.n_kv_heads, s.head_dim, device=device, dtype=dtype)

    def rope() -> None:
        rope_table(q, pos, cos, sin, s.rope_style)
        rope_table(k, pos, cos, sin, s.rope_style)

    yield Case("rope", "prefill", "rope_table q+k", f"[{t}, {s.n_heads}+{s.n_kv_heads}, "
               f"{s.head_dim}]", rope, 2 * (q.numel() + k.numel()) * e, calls=1)  # fmt: skip
    rep = s.n_heads // s.n_kv_heads
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).repeat_interleave(rep, 0)[None]
    mask = causal_lower_right(t, t)
    yield Case("attention", "prefill", "attention (torch sdpa)", f"{t} causal x {s.n_heads} heads",
               lambda: fn.scaled_dot_product_attention(qh, kh, kh, attn_mask=mask),
               4 * qh.numel() * e, 2 * t * t * s.n_heads * s.head_dim, dtype=dn)  # fmt: skip
    logits = torch.randn(t, s.n_experts, device=device, dtype=dtype)
    yield Case("router", "prefill", "route_topk", f"[{t}, {s.n_experts}] top-{s.top_k}",
               lambda: route_topk(logits, s.top_k, s.norm_topk),
               t * (s.n_experts * e + 8 * s.top_k))  # fmt: skip
    if experts:
        yield from _prefill_experts(s, device, dtype, cfg)


def _prefill_experts(
    s: BenchShapes, device: torch.device, dtype: torch.dtype, cfg: KernelConfigs
) -> Iterator[Case]:
    t, h, f, k, e = s.prefill, s.hidden, s.ffn, s.top_k, dtype.itemsize
    n = s.staged or s.n_experts
    dn = str(dtype).removeprefix("torch.")
    done: set[tuple[QType, bool]] = set()  # (type, down): each projection shape once per type
    for layer in expert_layers(s.mixes, s.hidden, s.ffn, n, device):
        shapes = ((f, h), (f, h), (h, f))
        same = layer.mix[0] == layer.mix[1]
        for p, (q, stack, (rows, cols)) in enumerate(zip(layer.mix, layer.stacks, shapes,
                                                         strict=True)):  # fmt: skip
            if (q, p == 2) in done:
                continue
            done.add((q, p == 2))
            proj = "down" if p == 2 else "gate/up" if same else ("gate", "up")[p]
            yield Case("dequant", "prefill", f"dequant {q.name} {proj}", f"{n} x [{rows}, {cols}]",
                       _dequant(stack, q, rows, cols, dtype, cfg),
                       stack.numel() + n * rows * cols * e)  # fmt: skip
    gate, up = (torch.randn(n, f, h, device=device, dtype=dtype) / h**0.5 for _ in range(2))
    down = torch.randn(n, h, f, device=device, dtype=dtype) / f**0.5
    xs = torch.randn(t * k, h, device=device, dtype=dtype)
    counts = torch.bincount(torch.arange(t * k, device=device) % n, minlength=n)
    # launched one by one: where torch has no grouped GEMM its loop reads the counts on the host
    yield Case("grouped", "prefill", "grouped_glu (GEMMs)", f"{t * k} rows x {n} experts",
               lambda: grouped_glu(xs, counts, gate, up, down),
               3 * n * f * h * e + 2 * t * k * h * e, 6 * t * k * f * h, dtype=dn,
               graph=False)  # fmt: skip


def _dequant(stack: torch.Tensor, q: QType, rows: int, cols: int, dtype: torch.dtype,
             cfg: KernelConfigs) -> Callable[[], object]:  # fmt: skip
    """A whole layer's projection dequantized as prefill's staging does it: split Q4_0 into
    an output buffer it reuses, the GGUF-block types into a fresh one."""
    if q != QType.Q4_0:
        return lambda: dequant_blocks(stack, q, rows, cols, dtype)
    out = torch.empty((stack.shape[0], rows, cols), device=stack.device, dtype=dtype)
    return lambda: dequant_q4_0_split(stack, rows, cols, dtype, out=out, config=cfg.dequant)


def run_cases(
    s: BenchShapes,
    device: torch.device,
    dtype: torch.dtype,
    cfg: KernelConfigs,
    groups: tuple[str, ...] = GROUPS,
    progress: Callable[[str], None] = print,
    rep_ms: int = 20,
) -> list[Row]:
    """Every case of `groups`, timed; a case that fails says why and is left out."""
    rows = []
    for n, case in enumerate(c for c in cases(s, device, dtype, cfg, groups) if c.group in groups):
        label = f"[{n + 1:2}] {case.phase} {case.kernel}"
        try:
            if device.type == "cuda":
                case.run()  # compile, warm (the interpreter has nothing to warm: one call)
            us = time_us(case.run, device, rep_ms, case.graph) / case.calls
        except Exception as err:  # a kernel this stack refuses: the report says so
            progress(f"{label}: failed ({err.__class__.__name__}: {err})")
            continue
        progress(f"{label}: {us:.1f} us")
        rows.append(Row(case.phase, case.kernel, case.shape, us, case.nbytes, case.flops,
                        case.link, case.dtype or str(dtype).removeprefix("torch.")))  # fmt: skip
    return rows
