"""What verifying a draft costs the offload engine: a step of one sequence's pending token
and k drafted tokens (every position's logits), against a decode step of one token.

    python -m bench.gpu.verify_cost --model a3b.gguf --expert-vram-gib 4 --drafts 1,2,4,8

One sequence prefills a random prompt of --prompt-len tokens, then for each k times
--repeats steps of k + 1 tokens (the cache truncated back after each, as a rejected draft
is) and as many decode steps (captured graphs where the engine uses them). Prints per k the
median step time and its ratio to a decode step: with acceptance a per drafted token, a
verify of k yields (1 - a^(k+1)) / (1 - a) tokens, so drafting pays where that exceeds the
ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.gpu.one_sequence import one_sequence
from stratad.engine.batch import Seq
from stratad.engine.offload.forward import OffloadForward


def _timed(engine: OffloadForward, seq: Seq, repeats: int) -> list[float]:
    """Seconds per step of `seq`'s tokens, the cache truncated back after each."""
    cache, out = seq.cache, []
    start = cache.length
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step([seq])
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
        cache.truncate(start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.verify_cost", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--expert-vram-gib", type=float, default=4.0)
    p.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2, 4, 8])  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernel-table", default=None)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    context = args.prompt_len + max(args.drafts) + 16
    one = one_sequence(args.model, args.expert_vram_gib, context, args.prompt_len,
                       args.kernel_table)  # fmt: skip
    model, engine, cache, prompt, gen = one.model, one.engine, one.cache, one.prompt, one.gen
    engine.step([Seq(cache, prompt)])
    token = [int(prompt[-1])]
    decode = _timed(engine, Seq(cache, token), args.repeats + 5)[5:]  # after the capture
    timings = [(0, decode)]
    for k in args.drafts:
        drafted = token + torch.randint(0, model.spec.vocab_size, (k,), generator=gen).tolist()
        times = _timed(engine, Seq.logits(cache, drafted, every=True), args.repeats + 2)[2:]
        timings.append((k, times))
    base = statistics.median(decode)
    rows = [{"k": k, "ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
             "max_ms": 1e3 * max(t), "x_decode": statistics.median(t) / base}
            for k, t in timings]  # fmt: skip
    print(f"expert VRAM {args.expert_vram_gib} GiB, {engine.experts.n_slots} slots, a sequence"
          f" at {args.prompt_len} tokens; median of {args.repeats}")
    print("| drafted k | ms/step | x decode step |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| {r['k'] or 'decode'} | {r['ms']:.2f} ({r['min_ms']:.2f}–{r['max_ms']:.2f}) |"
              f" {r['x_decode']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
