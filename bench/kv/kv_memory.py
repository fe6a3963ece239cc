"""What the working KV caches of `server.parallel` cost the daemon in RAM, with short prompts.

    python -m bench.kv.kv_memory [--model PATH] [--parallel 1,8] [--context 4096]
                                 [--max-tokens 32] [--json PATH]

For each `server.parallel` value, starts `stratad` (the engine `auto` picks on this host; on a
CPU host its caches are host RAM) with `model.max_context = --context`, reads its resident
memory (VmRSS, through the pid its control socket reports) once it serves, then sends as many
short completions at once as it runs and reads it again. Prints per parallel value the KV the
start plan reserves (the start-up log's line) and the resident memory before and after the
requests. The default model is the packaged SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.http.daemon import daemon

MiB = 1 << 20


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def measure(model: str | None, parallel: int, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    from stratactl.client import Client
    from stratad.protocol import StatusReply, StatusRequest

    work = Path(tempfile.mkdtemp(prefix="strata-kv-"))
    sock = work / "stratad.sock"
    config = (f'[model]\nmax_context = {args.context}\naliases = ["m"]\n'
              f'[server]\nparallel = {parallel}\n[control]\nsocket = "{sock}"\n')  # fmt: skip
    with daemon(model, work, config) as url:
        pid = Client(sock).request(StatusRequest(), StatusReply).pid
        started = _rss(pid)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def complete(i: int) -> int:
            out = client.completions.create(model="m", prompt=f"{i}, {i + 1}, {i + 2},",
                                            max_tokens=args.max_tokens, temperature=0)  # fmt: skip
            return out.usage.completion_tokens if out.usage else 0

        with ThreadPoolExecutor(parallel) as pool:
            tokens = sum(pool.map(complete, range(parallel)))
        served = _rss(pid)
    log = (work / "stratad.log").read_text()
    found = re.search(r"serving up to \d+ requests at once: (.*)", log)
    return {"parallel": parallel, "context": args.context, "completion_tokens": tokens,
            "rss_started_mib": started / MiB, "rss_served_mib": served / MiB,
            "plan": found.group(1) if found else "?"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model path (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--parallel", default="1,8", help="server.parallel values, comma-separated")
    p.add_argument("--context", type=int, default=4096, help="model.max_context")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request")
    p.add_argument("--json", type=Path, help="write the results here as well")
    args = p.parse_args(argv)
    rows = [measure(args.model, int(n), args) for n in args.parallel.split(",")]
    print("| server.parallel | KV the plan reserves | RSS serving (MiB) | RSS after requests |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['parallel']} | {r['plan']} | {r['rss_started_mib']:.0f} |"
              f" {r['rss_served_mib']:.0f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
