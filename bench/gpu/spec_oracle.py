"""Where speculation pays on the offload engine: greedy decoding with an oracle drafter.

    python -m bench.gpu.spec_oracle --model a3b.gguf --expert-vram-gib 4 --drafts 2,4,8

One sequence prefills a random prompt and decodes --tokens greedy tokens one step at a time
(the baseline, timed). The oracle then drafts from that very run: each drafted token is the
model's own next token with probability --acceptance, else a random one, so a draft is
accepted token by token with that probability (the first wrong token ends it). Each step
verifies the pending token and k drafts in one pass (every position's logits), keeps the
longest prefix the model agrees with plus its own next token, and cuts the KV cache back
past it, as the daemon's speculation does. Prints decode tokens/s per acceptance and k, the
speedup over the baseline, tokens per step, and how often a verify's token left the
oracle's (rounding differs between pass shapes; the oracle is then decoded again, untimed).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.gpu.one_sequence import one_sequence
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache
from stratad.engine.offload.forward import OffloadForward


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _baseline(
    engine: OffloadForward, cache: KVCache, first: int, n: int
) -> tuple[list[int], float]:
    """n greedy tokens after `first`, one decode step each: (tokens, seconds)."""
    out, token = [], first
    _sync()
    t = time.perf_counter()
    for _ in range(n):
        token = int(engine.step([Seq(cache, [token])])[0][-1].argmax())
        out.append(token)
    _sync()
    return out, time.perf_counter() - t


def _speculate(
    engine: OffloadForward, cache: KVCache, first: int, oracle: list[int], k: int,
    acceptance: float, vocab: int, rng: random.Random,
) -> tuple[list[int], float, int, int]:  # fmt: skip
    """len(oracle) greedy tokens after `first` with drafts of k from the oracle: (tokens,
    seconds, verify steps, times the oracle was rebuilt). Where a verify step's own token
    differs from the oracle's (rounding differs between pass shapes, and a random model's
    logits are close), the rest of the oracle is decoded again from there, untimed."""
    oracle, out, pending, steps, seconds, rebuilt = list(oracle), [], first, 0, 0.0, 0
    while len(out) < len(oracle):
        at = len(out)
        draft = [x if rng.random() < acceptance else rng.randrange(vocab)
                 for x in oracle[at : at + k]]  # fmt: skip
        start = cache.length
        _sync()
        t = time.perf_counter()
        logits = engine.step([Seq.logits(cache, [pending, *draft], every=True)])[0]
        best = logits.argmax(-1).tolist()
        kept = 0
        while kept < len(draft) and best[kept] == draft[kept]:
            kept += 1
        out += [*draft[:kept], best[kept]]
        pending = best[kept]
        cache.truncate(start + 1 + kept)
        seconds += time.perf_counter() - t
        steps += 1
        if len(out) < len(oracle) and out[-1] != oracle[len(out) - 1]:
            tail, _ = _baseline(engine, cache, pending, len(oracle) - len(out))
            cache.truncate(start + 1 + kept)
            oracle[len(out) :] = tail
            rebuilt += 1
    return out[: len(oracle)], seconds, steps, rebuilt


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.spec_oracle", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--expert-vram-gib", type=float, default=4.0)
    p.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    p.add_argument("--acceptance", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.3, 0.6, 0.9])  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel-table", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a check of the bench on a tiny model")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    context = args.prompt_len + args.tokens + max(args.drafts) + 16
    one = one_sequence(args.model, args.expert_vram_gib, context, args.prompt_len,
                       args.kernel_table, args.device)  # fmt: skip
    engine, cache, vocab = one.engine, one.cache, one.model.spec.vocab_size
    first = int(engine.step([Seq(cache, one.prompt)])[0][-1].argmax())
    start = cache.length

    def again() -> None:
        cache.truncate(start)

    engine.prepare(cache)  # every row count captured, as the daemon does at start
    oracle, _ = _baseline(engine, cache, first, args.tokens)  # warm
    base = []
    for _ in range(args.repeats):
        again()
        _, s = _baseline(engine, cache, first, args.tokens)
        base.append(args.tokens / s)
    rows: list[dict[str, object]] = []
    rng = random.Random(0)
    for a in args.acceptance:
        for k in args.drafts:
            again()
            _speculate(engine, cache, first, oracle, k, a, vocab, rng)  # warm: captures
            rates, steps, rebuilt = [], 0, 0
            for _ in range(args.repeats):
                again()
                _, s, steps, rebuilt = _speculate(engine, cache, first, oracle, k, a, vocab,
                                                  rng)  # fmt: skip
                rates.append(args.tokens / s)
            rows.append({"acceptance": a, "k": k, "tok_s": statistics.median(rates),
                         "min": min(rates), "max": max(rates),
                         "speedup": statistics.median(rates) / statistics.median(base),
                         "tokens_per_step": args.tokens / steps, "rebuilt": rebuilt})  # fmt: skip
    b = statistics.median(base)
    print(f"expert VRAM {args.expert_vram_gib} GiB, {engine.experts.n_slots} slots, prompt"
          f" {args.prompt_len}, {args.tokens} tokens, median of {args.repeats}")
    print(f"baseline decode: {b:.1f} tok/s ({min(base):.1f}–{max(base):.1f})")
    print("| acceptance | k | tok/s | speedup | tokens/step | oracle rebuilt |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['acceptance']} | {r['k']} | {r['tok_s']:.1f} ({r['min']:.1f}–{r['max']:.1f})"
              f" | {r['speedup']:.2f} | {r['tokens_per_step']:.2f} | {r['rebuilt']} |")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()},
            "baseline": {"tok_s": b, "min": min(base), "max": max(base)}, "rows": rows,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
