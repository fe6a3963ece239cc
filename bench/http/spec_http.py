"""Speculative decoding over HTTP: decode tokens/s with each drafter and without, on
workloads that repeat their input and one that does not.

    python -m bench.http.spec_http [--model PATH] [--drafters off,prompt_lookup,suffix]
                                   [--repeats 3] [--max-tokens 256] [--llamacpp BIN_DIR]
                                   [--json PATH]

For each drafter, starts `stratad` (`speculation.drafter`, one request at a time), then runs
each workload `--repeats` times, alternating drafters between repeats: a streamed greedy chat
completion (openai client), its decode rate taken as the completion tokens after the first
over the time from the first token to the last. Workloads (made here, no download): rewrite
a given 60-line Python function with one change; answer with quotes from a supplied text;
fill a JSON object from a supplied record; and a story with nothing to copy; then, in the same
daemon, another record for the same schema and the story asked again (where `suffix` drafts
from the answers given before). Prints each
workload's rate per drafter and the speedup over `off` (median of the repeats, spread). The
default model is the packaged SmolLM2-135M-Instruct. `--llamacpp`: a folder with
llama.cpp's `llama-lookup` built for this host (bench/llamacpp_build.sh, examples on): its
n-gram lookup decoding on the same prompts (rendered with the model's chat template), greedy,
`--spec-draft-n-max 8`, its own decode rate, in the same alternation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.http.daemon import daemon


def _function() -> str:
    """A 60-line Python function (deterministic)."""
    lines = ["def summarize(orders, rates, threshold=10):",
             '    """Totals per customer, with discounts and tax."""',
             "    totals = {}"]  # fmt: skip
    for i in range(11):
        lines += [f"    for order in orders[{i}::11]:",
                  f"        amount = order['price'] * order['count'] * rates[{i % 3}]",
                  f"        if amount > threshold * {i + 1}:",
                  "            who = order['customer']",
                  "            totals[who] = totals.get(who, 0) + amount"]  # fmt: skip
    lines += ["    # the customers above the threshold", "    return totals"]
    return "\n".join(lines)


TEXT = ("The lighthouse stood on the northern cape for two hundred years. Its keeper, Anna Berg,"
        " wrote in her log every evening: the weather, the ships that passed, the birds. In the"
        " winter of 1911 she recorded a storm that lasted nine days and sank three fishing boats."
        " The town later built a memorial for the lost sailors beside the harbour wall. Anna"
        " kept the light until 1932, when an electric lamp replaced the oil burners.")  # fmt: skip
RECORD = ("name: Maria Lopez; born: 1984-03-12; city: Valencia; email: maria.lopez@example.org;"
          " phone: +34 600 123 456; occupation: marine biologist; employer: Oceanographic"
          " Institute; languages: Spanish, English, Catalan")  # fmt: skip
RECORD2 = ("name: Tomas Novak; born: 1979-11-02; city: Brno; email: t.novak@example.net;"
           " phone: +420 731 555 010; occupation: railway engineer; employer: Czech Railways;"
           " languages: Czech, German")  # fmt: skip
SCHEMA = ("Write this record as a JSON object with the keys name, born, city, email, phone,"
          " occupation, employer, languages (a list).")  # fmt: skip

WORKLOADS = {
    "rewrite": f"Rewrite this function with `threshold` renamed to `limit`. Give the whole"
               f" function, nothing else.\n\n```python\n{_function()}\n```",
    "quotes": f"Text:\n{TEXT}\n\nQuote, word for word, every sentence of the text that"
              f" mentions the keeper.",
    "schema": f"Record: {RECORD}\n\n{SCHEMA}",
    "plain": "Tell a short story about a fox who learns to sail.",
    # asked after the two above in the same daemon: another record of the same schema (an
    # agent's next tool call), and the story again (a retry): text of a shape already answered
    "schema_again": f"Record: {RECORD2}\n\n{SCHEMA}",
    "retry": "Tell a short story about a fox who learns to sail.",
}


def _rate(base: str, prompt: str, max_tokens: int) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
    first = last = None
    tokens = 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    span = (last or 0.0) - (first or 0.0)
    return {"tokens": tokens, "decode_tok_s": (tokens - 1) / span if span > 0 else 0.0}


def _lookup(binary: Path, model: Path, prompt: str, max_tokens: int, work: Path) -> float:
    """llama-lookup's decode rate (tokens/s) on the chat-templated `prompt`."""
    from stratad.model.text.chat_template import render_chat
    from stratad.store.loader import load_model

    template = load_model(model).metadata.get("tokenizer.chat_template")
    text = render_chat(str(template), [{"role": "user", "content": prompt}])
    path = work / "prompt.txt"
    path.write_text(text)
    cmd = [str(binary), "-m", str(model), "-f", str(path), "-n", str(max_tokens), "--temp", "0",
           "-t", str(os.cpu_count() or 1), "--spec-draft-n-max", "8"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    found = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s",
                      out.stdout + out.stderr)  # fmt: skip
    if found is None:
        raise RuntimeError(f"no decode rate in llama-lookup's output: {out.stderr[-500:]}")
    return float(found.group(1))


def main() -> None:
    from stratad.model.default import default_model_path

    p = argparse.ArgumentParser(prog="python -m bench.http.spec_http", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--drafters", default="off,prompt_lookup,suffix")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--llamacpp", type=Path, help="folder holding llama.cpp's llama-lookup")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model = args.model or default_model_path()
    drafters = args.drafters.split(",")
    lookup = args.llamacpp / "llama-lookup" if args.llamacpp else None
    if lookup is not None and not lookup.is_file():
        p.error(f"no llama-lookup in {args.llamacpp}")
    peer: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    runs: dict[str, dict[str, list[float]]] = {d: {w: [] for w in WORKLOADS} for d in drafters}
    tokens: dict[str, dict[str, int]] = {d: {} for d in drafters}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            if lookup is not None:
                for w, prompt in WORKLOADS.items():
                    peer[w].append(_lookup(lookup, Path(model), prompt, args.max_tokens,
                                           Path(tmp)))  # fmt: skip
                    print(f"repeat {r}, llama-lookup, {w}: {peer[w][-1]:.1f} tok/s",
                          file=sys.stderr, flush=True)  # fmt: skip
            for d in drafters if r % 2 == 0 else drafters[::-1]:
                config = ('[model]\naliases = ["m"]\nmax_context = 2048\n[server]\nparallel = 1\n'
                          f'[control]\nsocket = ""\n[speculation]\ndrafter = "{d}"\n')  # fmt: skip
                work = Path(tmp) / f"{d}-{r}"
                work.mkdir()
                with daemon(str(model), work, config) as base:
                    _rate(base, "Hi", 4)  # warm up
                    for w, prompt in WORKLOADS.items():
                        got = _rate(base, prompt, args.max_tokens)
                        runs[d][w].append(got["decode_tok_s"])
                        tokens[d][w] = int(got["tokens"])
                        print(f"repeat {r}, {d}, {w}: {got['decode_tok_s']:.1f} tok/s,"
                              f" {got['tokens']:.0f} tokens", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"model": Path(model).name, "max_tokens": args.max_tokens,
                              "repeats": args.repeats, "rows": []}  # fmt: skip
    extra = " llama-lookup tok/s |" if lookup is not None else ""
    others = drafters[1:]
    print("| workload | " + " | ".join(f"{d} tok/s" for d in drafters) + " | "
          + " | ".join(f"{d} speedup" for d in others) + f" |{extra}")  # fmt: skip
    print("|" + " --- |" * (len(drafters) + len(others) + 1 + (lookup is not None)))
    for w in WORKLOADS:
        med = {d: statistics.median(runs[d][w]) for d in drafters}
        base = med[drafters[0]]
        cells = " | ".join(f"{med[d]:.1f} ({min(runs[d][w]):.1f}–{max(runs[d][w]):.1f})"
                           for d in drafters)  # fmt: skip
        gains = " | ".join(f"{med[d] / base:.2f}x" for d in others)
        theirs = (f" {statistics.median(peer[w]):.1f} ({min(peer[w]):.1f}–{max(peer[w]):.1f}) |"
                  if peer[w] else "")  # fmt: skip
        print(f"| {w} | {cells} | {gains} |{theirs}")
        result["rows"].append({"workload": w, "tok_s": {d: runs[d][w] for d in drafters},
                               "tokens": {d: tokens[d][w] for d in drafters},
                               "llama_lookup_tok_s": peer[w],
                               "speedup": {d: med[d] / base for d in others}})  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
