"""The cpu engine's kernels timed at a model's shapes against the host's memory read rate
(`stratactl bench kernels` on a host without a GPU).

The cpu engine reads every weight from its GGUF blocks with the compiled kernels
(`kernels.cpu.experts`): a projection (q, k, v, o, the router, the output head; a dense
model's gate, up and down) with `PreparedMatmul`, a layer's routed experts with `PreparedMoE`
(`kernels/cpu/dense.py` and `kernels/cpu/moe_stack.py` run the same products for every layer
in one call). Each product is timed once per weight type the model holds it in, at a decode
step (one token), a step of 4 and of 8 sequences (which share each read of a weight) and a
prefill chunk (`server.prefill_chunk` tokens; the head computes a prompt's last token only,
so it has no prefill row). The experts are routed at random: a step reads the distinct
experts its tokens chose.

A decode step reads every weight from memory (a model is larger than any cache), so a case cycles
through copies of its weights that outgrow the last-level cache. Its ideal time is the largest of
its weight bytes over the host's read rate (`stratad.store.placement.hostmem.read_bps`), its
multiply-adds over a float32 GEMM's rate on the same cores (torch's), and the floor of a call (the
smallest product, timed as the others are); `kernels.tuning.roofline.judge` holds the measured
time to it. The weights are random blocks (`stratad.tuning.bench_weights.random_blocks`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu.experts import CpuExperts, PreparedMatmul
from kernels.formats.quant import QType, row_bytes
from kernels.tuning.roofline import Ceilings, Judged, Row, matmul_tflops, summary
from stratad.model.spec import Model
from stratad.model.synthetic.presets import VOCAB_SIZE, SynthPreset
from stratad.store.placement.hostmem import read_bps
from stratad.tuning.bench_weights import Mix, mix_name, random_blocks

GROUPS = ("linear", "moe")  # the GPU report's groups these kernels belong to
BATCHES = (4, 8)  # sequences of a decode step, beside the single one
MAX_CALLS = 1024  # kernel calls per timed sweep (a tiny weight's copies)


@dataclass(frozen=True)
class Product:
    """A weight product the cpu engine runs: [rows, cols] in `qtype`; `names` the model's
    weights of that shape and type ("q/o")."""

    names: str
    rows: int
    cols: int
    qtype: QType
    prefill: bool = True  # computed for a whole prompt chunk (the head: for its last token)

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.qtype, self.cols)


@dataclass(frozen=True)
class CpuShapes:
    hidden: int
    ffn: int  # one expert's (a dense model: its FFN's)
    n_experts: int  # 0: a dense model
    top_k: int
    products: tuple[Product, ...]
    mixes: tuple[Mix, ...]  # each (gate, up, down) type the experts hold
    prefill: int = 128  # server.prefill_chunk's default
    left_out: tuple[str, ...] = ()  # weights the kernels do not read (the engine dequantizes)

    @classmethod
    def of_model(cls, model: Model, prefill: int = 128) -> CpuShapes:
        """The products of every layer of `model` (its header and types; nothing is read)."""
        from stratad.model.archs import ARCHS
        from stratad.model.weights import MLPWeights, MoEWeights

        spec = model.spec
        named: list[tuple[str, tuple[int, ...], QType]] = []
        mixes: list[Mix] = []
        for i in range(spec.n_layers):
            w = ARCHS[spec.arch].layer(model, i)
            a, m = w.gqa, w.mlp
            named += [(n, t.shape, t.qtype) for n, t in (("q", a.q), ("k", a.k), ("v", a.v),
                                                           ("o", a.o))]  # fmt: skip
            dense = m if isinstance(m, MLPWeights) else None
            if isinstance(m, MoEWeights):
                named.append(("router", m.router.shape, m.router.qtype))
                ex = m.experts
                mix = (ex.gate.qtype, ex.up.qtype, ex.down.qtype)
                if mix not in mixes:
                    mixes.append(mix)
                if m.shared is not None:
                    named += [(f"shared {n}", t.shape, t.qtype) for n, t in
                              (("gate", m.shared.gate), ("up", m.shared.up),
                               ("down", m.shared.down))]  # fmt: skip
            if dense is not None:
                named += [(n, t.shape, t.qtype) for n, t in (("gate", dense.gate),
                          ("up", dense.up), ("down", dense.down))]  # fmt: skip
        head = model.tensor("model.embed_tokens.weight" if spec.tie_embeddings
                            else "lm_head.weight")  # fmt: skip
        named.append(("head", head.shape, head.qtype))
        ffn = spec.expert_ffn if spec.is_moe else spec.ffn
        return cls._of(spec.hidden, ffn, spec.n_experts if spec.is_moe else 0,
                       spec.n_experts_used, named, tuple(mixes), prefill)  # fmt: skip

    @classmethod
    def of_preset(cls, p: SynthPreset, prefill: int = 128) -> CpuShapes:
        """A synth preset's products in its own types (`stratad.model.synthetic.presets`)."""
        h, f, a = p.hidden, p.ffn, p.attn_qtype
        named: list[tuple[str, tuple[int, ...], QType]] = [
            ("q", (p.q_dim, h), a), ("k", (p.kv_dim, h), a), ("v", (p.kv_dim, h), a),
            ("o", (h, p.q_dim), a)]  # fmt: skip
        if p.is_moe:
            named.append(("router", (p.n_experts, h), p.router_qtype))
        else:
            named += [("gate", (f, h), p.ffn_qtype), ("up", (f, h), p.ffn_qtype),
                      ("down", (h, f), p.ffn_qtype)]  # fmt: skip
        named.append(("head", (VOCAB_SIZE, h), p.embed_qtype))
        mixes = ((p.ffn_qtype,) * 3,) if p.is_moe else ()
        return cls._of(h, f, p.n_experts if p.is_moe else 0, p.n_experts_used, named,
                       mixes, prefill)  # fmt: skip

    @classmethod
    def _of(cls, hidden: int, ffn: int, n_experts: int, top_k: int,
            named: list[tuple[str, tuple[int, ...], QType]], mixes: tuple[Mix, ...],
            prefill: int) -> CpuShapes:  # fmt: skip
        """Each distinct (shape, type) once, named by every weight that has it."""
        groups: dict[tuple[int, int, QType, bool], list[str]] = {}
        left_out: list[str] = []
        for name, shape, qtype in named:
            rows, cols = shape[0], shape[-1]
            if len(shape) != 2 or qtype not in CpuExperts.supported or cols % 32:
                left_out.append(f"{name} {QType(qtype).name}")
                continue
            names = groups.setdefault((rows, cols, qtype, name != "head"), [])
            if name not in names:
                names.append(name)
        products = tuple(Product("/".join(n), r, c, q, pre)
                         for (r, c, q, pre), n in groups.items())  # fmt: skip
        read = tuple(m for m in mixes if all(q in CpuExperts.supported for q in m)
                     and hidden % 32 == 0 and ffn % 32 == 0)  # fmt: skip
        left_out += [f"experts {mix_name(m)}" for m in mixes if m not in read]
        return cls(hidden, ffn, n_experts, top_k, products, read, prefill,
                   tuple(dict.fromkeys(left_out)))  # fmt: skip

    def describe(self) -> str:
        weights = ", ".join(f"{p.names} [{p.rows}, {p.cols}] {QType(p.qtype).name}"
                            for p in self.products)  # fmt: skip
        experts = (f"; {self.n_experts} experts of {self.ffn} (top-{self.top_k}, "
                   f"{', '.join(mix_name(m) for m in self.mixes)})" if self.mixes else "")
        gone = f"; not read by the kernels: {', '.join(self.left_out)}" if self.left_out else ""
        return (f"hidden {self.hidden}: {weights}{experts}; 1, {', '.join(map(str, BATCHES))}"
                f" and {self.prefill} tokens{gone}")  # fmt: skip


@dataclass(frozen=True)
class Case:
    group: str  # "linear" or "moe"
    phase: str  # "decode" (one token), "batch4", "batch8", "prefill"
    kernel: str
    shape: str
    run: Callable[[], object]  # one sweep: `calls` kernel calls
    calls: int
    nbytes: int  # weight bytes a call reads
    flops: int  # per call


def _phases(prefill: int, with_prefill: bool = True) -> list[tuple[str, int]]:
    phases = [("decode", 1), *((f"batch{n}", n) for n in BATCHES)]
    return phases + [("prefill", prefill)] if with_prefill else phases


def random_weight(qtype: QType, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] of `qtype` as the cpu engine reads it: GGUF blocks (uint8)."""
    return random_blocks(qtype, rows, cols, torch.device("cpu"))


def _copies(nbytes: int, working: int) -> int:
    """Copies of `nbytes` whose sweep outgrows `working` bytes (at most `MAX_CALLS`)."""
    return max(1, min(MAX_CALLS, -(-working // max(nbytes, 1))))


def cases(s: CpuShapes, kernels: CpuExperts, working: int,
          groups: tuple[str, ...] = GROUPS) -> Iterator[Case]:  # fmt: skip
    """The cases of `groups`, built one product at a time (its copies go when the next are
    built); `working`: the bytes a decode sweep reads (past the last-level cache)."""
    if "linear" in groups:
        for p in s.products:
            yield from _matmul_cases(p, s.prefill, kernels, working)
    if "moe" in groups:
        for mix in s.mixes:
            yield from _expert_cases(s, mix, kernels, working)


def _matmul_cases(p: Product, prefill: int, kernels: CpuExperts, working: int) -> Iterator[Case]:
    first = random_weight(p.qtype, p.rows, p.cols)
    ws = [first, *(first.clone() for _ in range(_copies(p.nbytes, working) - 1))]
    mats = [kernels.prepare(w, p.qtype, p.rows, p.cols) for w in ws]
    name = f"matmul {p.names} {QType(p.qtype).name}"
    for phase, t in _phases(prefill, p.prefill):
        x = torch.randn(t, p.cols)
        # a prompt chunk is compute-bound: its weight once (from memory or not, it barely matters)
        calls = mats[:1] if phase == "prefill" else mats

        def run(calls: list[PreparedMatmul] = calls, x: torch.Tensor = x) -> None:
            for m in calls:
                m(x)

        yield Case("linear", phase, name, f"{t} x [{p.rows}, {p.cols}]", run, len(calls),
                   p.nbytes, 2 * t * p.rows * p.cols)  # fmt: skip


def _expert_cases(s: CpuShapes, mix: Mix, kernels: CpuExperts, working: int) -> Iterator[Case]:
    """One layer's routed experts through `PreparedMoE`, from a pool of distinct copies of one
    random expert (as many as the layer's experts, or the working set's, if more)."""
    h, f, k, e = s.hidden, s.ffn, s.top_k, s.n_experts
    shapes = ((f, h), (f, h), (h, f))
    parts = [random_weight(q, r, c).reshape(1, -1) for q, (r, c) in zip(mix, shapes, strict=True)]
    blob = sum(p.numel() for p in parts)
    pool = max(e, min(MAX_CALLS * k, -(-working // blob)))
    gate, up, down = (p.repeat(pool, 1) for p in parts)  # [pool, bytes]: distinct memory
    moe = kernels.prepare_moe(gate, up, down, mix, h, f)
    gen = torch.Generator().manual_seed(0)
    for phase, t in _phases(s.prefill):
        # each call a layer: t tokens' k experts of e at random, placed at a random pool offset
        routes = []
        for _ in range(1 if phase == "prefill" else MAX_CALLS):
            picks = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
            base = int(torch.randint(pool, (1,), generator=gen))
            routes.append(((picks + base) % pool, len(picks.unique())))
            if sum(d for _, d in routes) * blob >= working:
                break
        x, out = torch.randn(t, h), torch.zeros(t, h)
        weights = torch.full((t, k), 1.0 / k)

        def run(routes: list[tuple[torch.Tensor, int]] = routes, x: torch.Tensor = x,
                out: torch.Tensor = out, weights: torch.Tensor = weights) -> None:  # fmt: skip
            for ids, _ in routes:
                moe(x, ids, weights, out)

        distinct = sum(d for _, d in routes) / len(routes)
        yield Case("moe", phase, f"experts {mix_name(mix)}",
                   f"{t}x{k}: {distinct:.0f} of {e} experts", run, len(routes),
                   round(distinct * blob), 6 * t * k * f * h)  # fmt: skip


def _median_sweep(run: Callable[[], object], budget_s: float) -> float:
    """Seconds of one sweep: the median of at least 3 within `budget_s` (after 3 untimed,
    which page the copies in and let each product's team size settle, `kernels.cpu.team`)."""
    for _ in range(3):
        run()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_cases(
    s: CpuShapes,
    kernels: CpuExperts,
    working: int,
    groups: tuple[str, ...] = GROUPS,
    progress: Callable[[str], None] = print,
    budget_s: float = 0.2,
) -> list[Row]:
    """Every case of `groups`, timed: microseconds per call, its weight bytes and FLOPs."""
    rows = []
    for n, case in enumerate(cases(s, kernels, working, groups)):
        us = _median_sweep(case.run, budget_s) / case.calls * 1e6
        progress(f"[{n + 1:2}] {case.phase} {case.kernel}: {us:.1f} us")
        rows.append(Row(case.phase, case.kernel, case.shape, us, case.nbytes, case.flops,
                        link="read", dtype="float32"))  # fmt: skip
    return rows


# --- the host's ceilings ---------------------------------------------------------------------


def measure_ceilings(kernels: CpuExperts, quick: bool = False) -> Ceilings:
    """The host's memory read rate (every core), a float32 GEMM's rate (torch's threads) and
    the floor of a kernel call (a [32, 32] product, one token). The copy rates do not apply."""
    read = read_bps((256 << 20) if quick else (1 << 30)) / 1e9
    gemm = matmul_tflops(512 if quick else 1024, torch.float32, torch.device("cpu"))
    small = kernels.prepare(random_weight(QType.Q8_0, 32, 32), QType.Q8_0, 32, 32)
    x = torch.randn(1, 32)
    floor = _median_sweep(lambda: [small(x) for _ in range(200)], 0.05) / 200 * 1e6
    return Ceilings(0.0, 0.0, {"float32": gemm}, floor, read_gbs=read)


def last_level_cache() -> int:
    """Bytes of the largest CPU cache (sysfs), else 32 MiB."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine's."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == "model name":
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


def table(judged: list[Judged], flag_below: float, read_gbs: float) -> str:
    """The report as one table: each row's weight bytes per call, their GB/s and its share of
    the read rate; its share of the roofline and what bounds it; the flagged and the slowest."""
    lines = [f"{'phase':8} {'kernel':30} {'shape':26} {'us':>9} {'weights':>9} {'GB/s':>7}"
             f" {'of read':>7} {'share':>6} {'bound':>6}"]  # fmt: skip
    for j in judged:
        r = j.row
        gbs = r.nbytes / r.us / 1e3 if r.us > 0 else 0.0
        mark = "  << slow" if j.flagged else ""
        lines.append(f"{r.phase:8} {r.kernel:30.30} {r.shape:26.26} {r.us:9.1f}"
                     f" {_size(r.nbytes):>9} {gbs:7.2f} {gbs / read_gbs:7.0%} {j.share:6.0%}"
                     f" {j.bound:>6}{mark}")  # fmt: skip
    return "\n".join(lines + summary(judged, flag_below))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
