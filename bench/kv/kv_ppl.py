"""Perplexity with a quantized KV cache against plain KV, on a long real text.

    python -m bench.kv.kv_ppl [--model FILE] --formats plain,int8,q4 --tokens 8192 --context 2048
                              [--engine reference|cpu]

The text is the prose of the Python documentation that ships with Python (`pydoc_data`: the
language reference's topics), tokenized whole. It is cut into windows of --context tokens;
each window runs through the engine in chunks of --chunk tokens, and each token after the
window's first is scored. The reference engine rounds every key and value the cache holds as
the format stores it (`stratad.engine.kv_format`); the cpu engine stores the format itself,
in its compiled layers. Prints the perplexity per format and its change
against plain KV, the same windows for every format.
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import time
from pathlib import Path

import torch

from stratad.config import EngineConfig
from stratad.engine.kv_format import FORMATS, KVFormat
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import cpu_weights
from stratad.model.spec import Model
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.store.loader import load_model


def python_docs_text() -> str:
    """The Python documentation's topics, in a fixed order."""
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def nll(model: Model, fmt: KVFormat, windows: list[list[int]], chunk: int,
        engine: str = "reference") -> tuple[float, int]:  # fmt: skip
    """(summed negative log-likelihood, tokens scored) over the windows with `fmt`."""
    weights = cpu_weights(EngineConfig()) if engine == "cpu" else None  # as the daemon's
    forward = ReferenceForward(model, weights=weights, kv_format=fmt)
    total, scored = 0.0, 0
    for window in windows:
        cache = forward.new_cache(len(window))
        logits = torch.cat([forward(window[at : at + chunk], cache, all_logits=True)
                            for at in range(0, len(window), chunk)])  # fmt: skip
        logp = torch.log_softmax(logits[:-1].double(), dim=-1)
        target = torch.tensor(window[1:])
        total -= float(logp.gather(1, target[:, None]).sum())
        scored += len(window) - 1
    return total, scored


def main() -> None:
    from stratad.model.default import default_model_path

    p = argparse.ArgumentParser(prog="python -m bench.kv.kv_ppl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: SmolLM2-135M)")
    p.add_argument("--formats", default="plain,int8,q4",
                   help=f"KV formats, of {', '.join(FORMATS)}")  # fmt: skip
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the text scored")
    p.add_argument("--context", type=int, default=2048, help="tokens per window")
    p.add_argument("--chunk", type=int, default=512, help="tokens per forward call")
    p.add_argument("--engine", choices=("reference", "cpu"), default="reference",
                   help="reference: torch over float weights; cpu: the compiled CPU layers")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        p.error(f"--formats: {', '.join(unknown) or 'none'}: expected some of {', '.join(FORMATS)}")
    path = args.model or default_model_path()
    model = load_model(path)
    tokens = tokenizer_from_gguf(model.metadata).encode(python_docs_text(), add_special=False)
    n = min(args.tokens, len(tokens)) // args.context * args.context
    if n == 0:
        p.error(f"the text has {len(tokens)} tokens: fewer than one --context window")
    windows = [tokens[at : at + args.context] for at in range(0, n, args.context)]
    rows = []
    for name in names:
        t = time.perf_counter()
        total, scored = nll(model, FORMATS[name], windows, args.chunk, args.engine)
        rows.append({"format": name, "ppl": math.exp(total / scored), "tokens": scored,
                     "seconds": time.perf_counter() - t})  # fmt: skip
    base = next((r["ppl"] for r in rows if r["format"] == "plain"), None)
    print(f"{path.name}: the Python documentation's topics, {len(windows)} windows of"
          f" {args.context} tokens ({n} tokens), chunks of {args.chunk}, the {args.engine}"
          " engine")
    print("| KV | perplexity | vs plain |")
    print("| --- | ---: | ---: |")
    for r in rows:
        delta = "" if base is None else f"{100 * (r['ppl'] / base - 1):+.3f}%"
        r["delta_pct"] = None if base is None else 100 * (r["ppl"] / base - 1)
        print(f"| {r['format']} | {r['ppl']:.4f} | {delta} |")
    if args.json:
        args.json.write_text(json.dumps({"model": path.name, "args": {
            k: str(v) for k, v in vars(args).items() if k != "model"}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
