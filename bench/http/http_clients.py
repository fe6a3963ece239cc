"""Several clients over HTTP: the daemon's throughput as clients are added, per
`server.parallel`.

    python -m bench.http.http_clients [--model PATH] [--parallel 1,4] [--clients 1,4]
                                      [--max-tokens 64] [--requests 3] [--rounds 1]
                                      [--temperature 0] [--top-p 1] [--json PATH]
                                      [--set SECTION.KEY=VALUE ...]

For each `server.parallel` value, starts `stratad` (its own process, a free port, the
engine `auto` picks on this host), and for each client count runs that many clients at once,
each sending `--requests` completions one after another (`openai`, greedy unless
`--temperature` and `--top-p` say otherwise, a prompt that each client varies so that no two
share a prefix). Prints per (parallel, clients): completion tokens per second summed over
the clients (tokens the server reported in `usage`, over the wall time of the whole round),
the median request latency, and the median time to the first token of a streamed request;
with `--rounds 3`, the median of three rounds and their spread. The default model is the
packaged SmolLM2-135M-Instruct. `--set` adds a setting to the daemon's config (a TOML value:
`--set store.expert_cache=1392` gives a GPU a fixed expert budget, `--set
model.max_context=1024`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.http.daemon import daemon

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def _openai(base: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _client(client: Any, index: int, args: argparse.Namespace) -> list[dict[str, float]]:
    out = []
    for r in range(args.requests):
        prompt = f"{index * 100 + r}, {index * 100 + r + 1}, {index * 100 + r + 2},"
        t0 = time.perf_counter()
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=args.max_tokens,
                                           temperature=args.temperature, top_p=args.top_p,
                                           stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        first, tokens = None, 0
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        out.append({"seconds": time.perf_counter() - t0, "first_token_s": first or 0.0,
                    "tokens": tokens})  # fmt: skip
    return out


def run_round(base: str, clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """`clients` clients at once, each made (an HTTP client, its TLS context) and its thread
    started before the clock starts: the wall is the requests' alone."""
    made = [_openai(base) for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def run(i: int) -> list[dict[str, float]]:
        start.wait()
        return _client(made[i], i, args)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(run, i) for i in range(clients)]
        start.wait()
        t0 = time.perf_counter()
        per_client = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    reqs = [r for c in per_client for r in c]
    tokens = sum(r["tokens"] for r in reqs)
    return {"clients": clients, "requests": len(reqs), "completion_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_s": statistics.median(r["seconds"] for r in reqs),
            "first_token_s": statistics.median(r["first_token_s"] for r in reqs)}  # fmt: skip


def config_text(parallel: int, settings: list[str]) -> str:
    """The daemon's config: the benchmark's own settings, then each `SECTION.KEY=VALUE` (a
    TOML value) in its section."""
    sections: dict[str, dict[str, str]] = {
        "model": {"aliases": '["m"]'},
        "server": {"parallel": str(parallel), "max_queue": "256"},
        "control": {"socket": '""'},
    }
    for item in settings:
        name, sep, value = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not (sep and dot and section and key and value.strip()):
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        sections.setdefault(section, {})[key] = value.strip()
    text = "".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
                   for name, keys in sections.items())  # fmt: skip
    tomllib.loads(text)  # a value that is not TOML fails here, not in the daemon
    return text


def serve(model: Path, parallel: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    config = config_text(parallel, args.set)
    with tempfile.TemporaryDirectory() as tmp, daemon(str(model), Path(tmp), config,
                                                      args.start_timeout) as base:  # fmt: skip
        _client(_openai(base), 999, argparse.Namespace(requests=1, max_tokens=4,
                                                       temperature=0.0, top_p=1.0))  # warm up
        rounds = []
        for clients in args.clients:
            for repeat in range(args.rounds):
                r = run_round(base, clients, args)
                r["parallel"], r["repeat"] = parallel, repeat
                rounds.append(r)
                print(f"parallel {parallel}, {clients} clients: {r['tokens_per_s']:.1f} tok/s in"
                      f" all, request {r['latency_s']:.2f} s, first token"
                      f" {r['first_token_s']:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
        if args.log:  # the daemon's log, its timing lines and warnings (its folder goes)
            shutil.copy(Path(tmp) / "stratad.log", args.log)
        return rounds


def summarize(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (server.parallel, clients): the median of its rounds and their spread."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rounds:
        groups.setdefault((r["parallel"], r["clients"]), []).append(r)
    out = []
    for (parallel, clients), rs in groups.items():
        rates = [r["tokens_per_s"] for r in rs]
        out.append({"parallel": parallel, "clients": clients, "rounds": len(rs),
                    "tokens_per_s": statistics.median(rates),
                    "spread": [min(rates), max(rates)],
                    "latency_s": statistics.median(r["latency_s"] for r in rs),
                    "first_token_s": statistics.median(r["first_token_s"] for r in rs)})
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [f"model {r['model']}, {r['max_tokens']} completion tokens a request, "
             f"{r['requests']} requests per client, the median of {r['rounds_each']} rounds", "",
             "| server.parallel | clients | tok/s in all | spread | request latency (s) |"
             " first token (s) |", "|" + " --- |" * 6]  # fmt: skip
    for x in r["summary"]:
        lines.append(f"| {x['parallel']} | {x['clients']} | {x['tokens_per_s']:.1f} |"
                     f" {x['spread'][0]:.1f}–{x['spread'][1]:.1f} |"
                     f" {x['latency_s']:.2f} | {x['first_token_s']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    from stratad.model.default import default_model_path

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--parallel", type=ints, default=[1, 4])
    p.add_argument("--clients", type=ints, default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=3, help="requests per client, in turn")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the clients' temperature (0: greedy, as the engine benchmarks decode)")
    p.add_argument("--top-p", type=float, default=1.0, help="the clients' top_p")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of each client count (the median is reported, with the spread)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--log", type=Path, help="keep a copy of the daemon's log here")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting for the daemon's config (repeatable)")
    args = p.parse_args()
    try:
        config_text(0, args.set)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        p.error(str(e))
    model = args.model or default_model_path()
    if not model.is_file():
        p.error(f"no model file at {model}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    rounds = [r for n in args.parallel for r in serve(model, n, args)]
    result = {"model": Path(model).name, "max_tokens": args.max_tokens, "requests": args.requests,
              "temperature": args.temperature, "top_p": args.top_p,
              "settings": args.set, "rounds_each": args.rounds, "rounds": rounds,
              "summary": summarize(rounds)}  # fmt: skip
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
