"""A model served on the CPU alone: Strata's `cpu` engine (the GGUF blocks read by the compiled
CPU kernels) next to llama.cpp (`llama-cpp-python`, no GPU layers) on the same file, in the
same run, each in a process of its own so that each one's resident memory is its own.

    python -m bench.cpu.cpu_only [--model PATH] [--prompt-len 256] [--decode-tokens 64]
                                 [--repeats 3] [--threads N] [--reference] [--json PATH]
                                 [--store-ram-gib G] [--memory-limit-gib L]
                                 [--llamacpp-repack on|off] [--cpu-interleave on|off]
                                 [--batch B]
                                 [--llama-bench PATH] [--alternate]

Per engine: prefill tokens/s of one prompt, greedy decode tokens/s after it, median and
spread of the repeats, and the process's resident memory after the runs (VmRSS) and at its
peak, next to the file's size. `--reference` adds the torch reference engine (float32 copies
of the weights) for scale. The default model is the packaged SmolLM2-135M-Instruct.

`--store-ram-gib G` (a MoE model) adds Strata's `cpu` engine as a CPU-only host's daemon serves
it: the experts through the expert store, G GiB of them in RAM (mlocked, as the daemon does,
pinned before the first prompt), the rest read from the file when routed, a step's experts in
one kernel call. Its store counters (hits per tier, file reads) come with its result. The
plan has no profile here: which experts stay in RAM is the plan's default order.

`--memory-limit-gib L` runs each engine as on a host with L GiB of RAM: in a memory cgroup of
its own (`bench/cpu/memlimit.py`; needs root), after the model file's cached pages are dropped, so
a model larger than L is read from the disk again wherever the kernel dropped its pages.
`--llamacpp-repack off` keeps llama.cpp's weights in the file's mapping (`--no-repack`;
llama-bench's `--repack 0`): by default it copies them into its own interleaved layout for the
CPU's vector units, which needs RAM for the whole model. `--cpu-interleave off` does the same
for Strata's weights (`engine.cpu_interleave`: by default its dense weights are copied into
rows interleaved in eights, and the store's RAM copies of experts are made so).

`--llama-bench PATH` times llama.cpp with its own tools built from source for this host
(`bench/llamacpp_build.sh SOURCE DIR cpu`: the host's instruction set, AMX off): `llama-bench`
(`-p`, `-n`, `-t`, `-r`), and `llama-batched-bench` beside it with `--batch`; without it, the
pip build of llama-cpp-python through its Python loop, which is no peer (a generic build, and
Python between tokens). `--alternate` runs the engines in turn, one repeat each, `--repeats`
times, so that a drift of the host's speed falls on both.

`--batch B` serves B clients at once: B prompts (different tokens) prefilled in one step, then
B sequences decoded together, one token each per step, as the daemon steps its running
requests (Strata: `forward.step`, one kernel call a step for all of them; llama.cpp: one
`llama_decode` over B sequence ids, as llama-server's parallel slots). Tokens/s are the sum
over the B sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.cpu import memlimit
from kernels.cpu.build import OMP_WAIT


def _rss() -> dict[str, int]:
    """Resident bytes now (VmRSS; its private part RssAnon, and RssFile: pages of mapped
    files, the model's among them) and at the peak."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss_bytes": kib["VmRSS"], "anon_bytes": kib["RssAnon"], "file_pages_bytes":
            kib["RssFile"], "peak_rss_bytes": peak}  # fmt: skip


def _prompt(n: int, vocab: int, seq: int = 0) -> list[int]:
    return [(1000 + 7919 * i + 104729 * seq) % vocab for i in range(n)]


def run_strata(args: argparse.Namespace, reference: bool) -> dict[str, Any]:
    import torch

    from kernels.cpu.experts import CpuExperts
    from stratad.engine.batch import Seq
    from stratad.engine.reference.forward import ReferenceForward
    from stratad.engine.reference.weights_mode import QuantWeights
    from stratad.store.loader import load_model

    # as the daemon runs them: the cpu engine leaves the cores to its kernels' team
    torch.set_num_threads(args.threads if reference else 1)
    model = load_model(args.model)
    kernels = CpuExperts(args.threads, interleave=args.cpu_interleave == "on")
    weights = None if reference else QuantWeights(kernels)
    store = _store(model, args.store_ram_gib, weights) if args.engine == "store" else None
    forward = ReferenceForward(model, weights=weights, experts=store)
    prompts = [_prompt(args.prompt_len, model.spec.vocab_size, b) for b in range(args.batch)]
    prefill, decode = [], []
    for _ in range(args.repeats):
        # the batch's sequences stepped together, as the daemon steps its running requests
        caches = [forward.new_cache(args.prompt_len + args.decode_tokens + 1) for _ in prompts]
        t0 = time.perf_counter()
        logits = forward.step([Seq(c, p) for c, p in zip(caches, prompts, strict=True)])
        prefill.append(args.batch * args.prompt_len / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens):
            nexts = [[int(lg[-1].argmax())] for lg in logits]
            logits = forward.step([Seq(c, n) for c, n in zip(caches, nexts, strict=True)])
        decode.append(args.batch * args.decode_tokens / (time.perf_counter() - t0))
    stats = {} if store is None else {"store": msgspec.to_builtins(store.stats())}
    return {"prefill_tps": prefill, "decode_tps": decode, "weights": forward.mode.name,
            **stats, **_rss()}  # fmt: skip


def _store(model: Any, ram_gib: float, weights: Any) -> Any:
    """The daemon's expert store on a CPU-only host: `ram_gib` of experts in RAM, mlocked and
    pinned before it returns (in the form the daemon's cpu engine makes them); the rest from
    the file."""
    import torch

    from stratad.config import StoreConfig
    from stratad.engine.reference.interleaved_ram import ram_form
    from stratad.store.placement.plan import Stage
    from stratad.store.startup import open_source, open_store

    config = StoreConfig(resident_budget_gib=ram_gib, pin_rate_gbps=0, ready_after_pinning=True)
    cpu = torch.device("cpu")
    source = open_source(config, model)
    stages = (Stage(range(model.spec.n_layers), 0),)
    form = None if weights is None else ram_form(weights, model, source, stages)
    store = open_store(config, source, compute_device=cpu, stages=stages, ram_form=form)
    while store.pinner.progress.pinned_bytes < store.ram.nbytes:
        time.sleep(0.2)
    return store


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp.llama_cpp as raw
    from llama_cpp import Llama

    if args.batch > 1:
        return _llamacpp_batch(args)
    if args.llamacpp_repack == "off":  # llama-cli's --no-repack: Llama() has no argument for it
        default = raw.llama_model_default_params

        def no_repack() -> Any:
            params = default()
            params.use_extra_bufts = False
            return params

        raw.llama_model_default_params = no_repack

    llm = Llama(str(args.model), n_gpu_layers=0, n_threads=args.threads,
                n_ctx=args.prompt_len + args.decode_tokens + 16, verbose=False)  # fmt: skip
    prompt = _prompt(args.prompt_len, llm.n_vocab())
    prefill, decode = [], []
    for _ in range(args.repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(args.prompt_len / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens):
            llm.eval([llm.sample(temp=0.0)])
        decode.append(args.decode_tokens / (time.perf_counter() - t0))
    return {"prefill_tps": prefill, "decode_tps": decode, **_rss()}


def run_llama_bench(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's own `llama-bench` (a native build: `bench/llamacpp_build.sh SOURCE DIR cpu`)
    timing its own loop: prefill of the prompt (`-p`) from an empty context, and decode of
    `--decode-tokens` (`-n`) after a context of the prompt's length (`-d`), the process's peak
    RSS from its rusage. `--batch` > 1: `llama-batched-bench`, beside it,
    with B sequences of the prompt each, decoded together (`-npl B`)."""
    binary = Path(args.llama_bench)
    if args.batch > 1:
        return _llama_batched_bench(binary.with_name("llama-batched-bench"), args)
    base = [str(binary), "-m", str(args.model), "-t", str(args.threads), "-r",
            str(args.repeats), "-o", "json", "--repack", "1" if args.llamacpp_repack == "on"
            else "0"]  # fmt: skip
    # the prompt from an empty context; the decode after it (-d: as Strata decodes here, not
    # from depth 0, where attention costs nothing)
    runs = (["-p", str(args.prompt_len), "-n", "0"],
            ["-p", "0", "-n", str(args.decode_tokens), "-d", str(args.prompt_len)])
    tests, cmds = [], []
    for extra in runs:
        cmd = base + extra
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_llama_env())
        tests += json.loads(out.stdout)
        cmds.append(" ".join(cmd))
    prefill = [t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0]
    decode = [t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"prefill_tps": [float(x) for x in prefill[0]["samples_ts"]],
            "decode_tps": [float(x) for x in decode[0]["samples_ts"]],
            "rss_bytes": peak, "peak_rss_bytes": peak,
            "build": f"{tests[0].get('build_commit', '?')} {tests[0].get('cpu_info', '')}".strip(),
            "command": "; ".join(_shown(c, args) for c in cmds)}  # fmt: skip


def _shown(command: str, args: argparse.Namespace) -> str:
    """A command as a result file records it: the binary and the model by their names (the
    host's folders say nothing of the run)."""
    command = command.replace(str(args.model), Path(args.model).name)
    return command.replace(str(Path(args.llama_bench).parent) + "/", "")


def _llama_env() -> dict[str, str]:
    """The environment llama.cpp's tools run in: this one without the passive OpenMP wait that
    `bench` asks for its own runtimes (`kernels.cpu.build.quiet_openmp`), which is not
    llama.cpp's setting and cuts its decode by two thirds here (45 against 130 tok/s)."""
    return {k: v for k, v in os.environ.items() if k != OMP_WAIT[0]}


def _llama_batched_bench(binary: Path, args: argparse.Namespace) -> dict[str, Any]:
    b, n, t = args.batch, args.prompt_len, args.decode_tokens
    cmd = [str(binary), "-m", str(args.model), "-c", str(b * (n + t + 16)), "-b", str(b * n),
           "-ub", "512", "-npp", str(n), "-ntg", str(t), "-npl", str(b), "-t", str(args.threads),
           "-kvu", "--output-format", "jsonl"]  # fmt: skip
    prefill, decode = [], []
    for _ in range(args.repeats):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_llama_env())
        lines = (out.stdout + "\n" + out.stderr).splitlines()
        rows = [json.loads(line) for line in lines if line.startswith("{")]
        prefill.append(float(rows[-1]["speed_pp"]))
        decode.append(float(rows[-1]["speed_tg"]))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"prefill_tps": prefill, "decode_tps": decode, "rss_bytes": peak,
            "peak_rss_bytes": peak, "command": _shown(" ".join(cmd), args)}  # fmt: skip


def _llamacpp_batch(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp with `--batch` sequences decoded together (as llama-server's parallel slots
    run them): one `llama_decode` a step over every sequence's token, each its own sequence id
    in a unified KV cache; the prompts in one call. Greedy, as `run_llamacpp`."""
    import llama_cpp.llama_cpp as raw
    import numpy as np

    raw.llama_backend_init()
    mp = raw.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, args.llamacpp_repack == "on"
    model = raw.llama_model_load_from_file(str(args.model).encode(), mp)
    n_vocab = raw.llama_vocab_n_tokens(raw.llama_model_get_vocab(model))
    b, n = args.batch, args.prompt_len
    cp = raw.llama_context_default_params()
    cp.n_ctx = b * (n + args.decode_tokens + 16)
    cp.n_batch, cp.n_seq_max, cp.kv_unified = b * n, b, True
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = raw.llama_init_from_model(model, cp)
    batch = raw.llama_batch_init(b * n, 0, 1)
    prompts = [_prompt(n, n_vocab, i) for i in range(b)]

    def decode_items(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, wants logits) in one call; each wanted row's argmax."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, wants) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants
        if raw.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(raw.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax())
                for i, item in enumerate(items) if item[3]]  # fmt: skip

    prefill, decode = [], []
    for _ in range(args.repeats):
        raw.llama_memory_clear(raw.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        nexts = decode_items([(tok, p, s, p == n - 1) for s, prompt in enumerate(prompts)
                              for p, tok in enumerate(prompt)])  # fmt: skip
        prefill.append(b * n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for step in range(args.decode_tokens):
            nexts = decode_items([(tok, n + step, s, True) for s, tok in enumerate(nexts)])
        decode.append(b * args.decode_tokens / (time.perf_counter() - t0))
    result = {"prefill_tps": prefill, "decode_tps": decode, **_rss()}  # before the frees
    raw.llama_batch_free(batch)
    raw.llama_free(ctx)
    raw.llama_model_free(model)
    return result


def _child(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one engine in a fresh interpreter (in a memory cgroup of its own when limited);
    its JSON result, or its failure (e.g. killed at the memory limit) as {"failed": why}."""
    cmd = [sys.executable, "-m", "bench.cpu.cpu_only", "--engine", engine,
           "--model", str(args.model),
           "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens),
           "--repeats", str(args.repeats), "--threads", str(args.threads),
           "--batch", str(args.batch),
           "--store-ram-gib", str(args.store_ram_gib), "--llamacpp-repack", args.llamacpp_repack,
           "--cpu-interleave", args.cpu_interleave,
           "--memory-limit-gib", str(args.memory_limit_gib),
           *(["--llama-bench", args.llama_bench] if args.llama_bench else []),
           "--cgroup", f"strata-bench-{os.getpid()}-{engine}"]  # fmt: skip
    if args.memory_limit_gib > 0:
        memlimit.drop_cached(args.model)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    finally:
        memlimit.remove(cmd[-1])
    if out.returncode != 0:
        why = out.stderr.strip()[-2000:] or f"exit status {out.returncode}"
        if out.returncode < 0:
            why = f"killed by signal {-out.returncode} (the memory limit?)"
        if args.memory_limit_gib <= 0:
            raise RuntimeError(f"{engine} failed: {why}")
        return {"failed": why}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fig(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}–{max(values):,.1f})"


def markdown(r: dict[str, Any]) -> str:
    size = r["file_bytes"] / 2**20
    lines = [f"model {r['model']} ({size:,.1f} MiB), {r['threads']} threads, prompt"
             f" {r['prompt_len']} tokens, {r['decode_tokens']} greedy decode tokens, "
             f"{r['repeats']} repeats", "",
             "| engine | prefill tok/s | decode tok/s | RSS after (MiB) | of it private |"
             " peak RSS (MiB) | RSS / file |", "|" + " --- |" * 7]  # fmt: skip
    for name, e in r["engines"].items():
        if "failed" in e:
            lines.append(f"| {name} | failed: {e['failed'][:200]} |" + " |" * 5)
            continue
        lines.append(f"| {name} | {_fig(e['prefill_tps'])} | {_fig(e['decode_tps'])} |"
                     f" {e['rss_bytes'] / 2**20:,.0f} | {e.get('anon_bytes', 0) / 2**20:,.0f} |"
                     f" {e['peak_rss_bytes'] / 2**20:,.0f} |"
                     f" {e['rss_bytes'] / r['file_bytes']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    from stratad.model.default import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoded together (several clients); figures are their sum",
    )
    p.add_argument("--reference", action="store_true", help="also the torch reference engine")
    p.add_argument(
        "--store-ram-gib",
        type=float,
        default=-1.0,
        help="also the cpu engine through the expert store, this much RAM (MoE)",
    )
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=0.0,
        help="each engine in a memory cgroup of this many GiB (root; 0: none)",
    )
    p.add_argument(
        "--llamacpp-repack",
        choices=["on", "off"],
        default="on",
        help="llama.cpp's CPU repacking of the weights (off: --no-repack)",
    )
    p.add_argument(
        "--cpu-interleave",
        choices=["on", "off"],
        default="on",
        help="Strata's interleaved copy of the dense weights (engine.cpu_interleave)",
    )
    p.add_argument(
        "--llama-bench",
        help="a native llama-bench binary (bench/llamacpp_build.sh ... cpu): llama.cpp timed by"
        " its own tool (llama-batched-bench beside it for --batch), in place of the pip build",
    )
    p.add_argument(
        "--alternate",
        action="store_true",
        help="run the engines in turn, one repeat each, --repeats times (against drift)",
    )
    p.add_argument("--cgroup", default="strata-bench", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=["strata", "store", "reference", "llamacpp", "llama-bench"],
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.model = args.model or default_model_path()
    if not args.model.is_file():
        p.error(f"no model file at {args.model}")
    if args.engine:  # a child: one engine, its result as one JSON line
        limit = args.memory_limit_gib
        group = memlimit.confine(limit, args.cgroup) if limit > 0 else None
        if args.engine == "llama-bench":
            result = run_llama_bench(args)
        elif args.engine == "llamacpp":
            result = run_llamacpp(args)
        else:
            result = run_strata(args, reference=args.engine == "reference")
        if group is not None:
            result["cgroup_peak_bytes"] = memlimit.peak_bytes(group)
        print(json.dumps(result))
        return
    engines = ["strata", "llama-bench" if args.llama_bench else "llamacpp"]
    engines += (["reference"] if args.reference else []) + (
        ["store"] if args.store_ram_gib >= 0 else [])  # fmt: skip
    result = {"model": args.model.name, "file_bytes": args.model.stat().st_size,
              "threads": args.threads, "prompt_len": args.prompt_len,
              "decode_tokens": args.decode_tokens, "repeats": args.repeats, "batch": args.batch,
              "memory_limit_gib": args.memory_limit_gib, "llamacpp_repack": args.llamacpp_repack,
              "engines": {}}  # fmt: skip
    rounds = args.repeats if args.alternate else 1
    per_round = argparse.Namespace(**{**vars(args), "repeats": 1}) if args.alternate else args
    for r in range(rounds):
        for name in engines:
            print(f"{name} ({r + 1} of {rounds}) ...", file=sys.stderr, flush=True)
            got = _child(name, per_round)
            seen = result["engines"].setdefault(name, got)
            if seen is not got and "failed" not in got:  # a later round: its figures too
                for key in ("prefill_tps", "decode_tps"):
                    seen[key] = seen[key] + got[key]
                seen["peak_rss_bytes"] = max(seen["peak_rss_bytes"], got["peak_rss_bytes"])
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
