"""Fuzz the HTTP API from the OpenAPI document the daemon serves, with schemathesis.

    python -m bench.http.fuzz_api [--model PATH] [--max-examples 40] [--max-time 600] [--seed 1]
                                  [--schemas] [--no-openapi]

Starts `stratad` on loopback (the default model unless --model; a short context and short
default completions keep each example cheap), points schemathesis at its `/openapi.json`
and runs its examples, coverage and fuzzing phases, bounded by an example count per operation
and a time limit. Checked: no 5xx (`not_a_server_error`), every answer's status, content type,
headers and body as the document describes them, bad input refused and valid input accepted.
Prints (and with --out writes) a Markdown summary: requests sent, 5xx answers, checks that
failed, tracebacks in the daemon's log. `--schemas` then sends the same daemon the hostile JSON
schema corpus of `bench/http/schema_corpus.py` (each answer 400 or valid JSON of the schema, never
5xx, /health within a second throughout); `--no-openapi` skips schemathesis.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.http import schema_corpus
from bench.http.daemon import daemon

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
    "positive_data_acceptance,unsupported_method"
)

CONFIG = """
[model]
max_context = {context}
[server]
host = "127.0.0.1"
max_queue = 4
default_max_tokens = 8
[control]
socket = ""
[engine]
threads = {threads}
"""


def schemathesis_cmd(url: str, args: argparse.Namespace, reports: Path) -> list[str]:
    return [
        sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
        "run", f"{url}/openapi.json",
        "--checks", args.checks,
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", str(args.max_examples),
        "--max-time", str(args.max_time),
        "--seed", str(args.seed),
        "--workers", "1",
        "--request-timeout", "120",
        "--suppress-health-check", "all",
        "--continue-on-failure",
        "--no-color",
        "--report", "har,ndjson",
        "--report-dir", str(reports),
        "--report-har-path", str(reports / "requests.har"),
        "--report-ndjson-path", str(reports / "events.ndjson"),
    ]  # fmt: skip


@dataclass
class Result:
    command: str
    exit_code: int
    seconds: float
    requests: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # one line per (check, operation)
    tracebacks: int = 0
    log_errors: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.by_status.items() if s >= 500)

    def markdown(self) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.by_status.items()))
        fails = "\n".join(f"- {f}" for f in self.failures) or "- none"
        errors = "\n".join(f"    {e}" for e in self.log_errors[:20]) or "    (none)"
        return (
            f"- command: `{self.command}`\n"
            f"- schemathesis exit code: {self.exit_code} ({self.seconds:.0f} s)\n"
            f"- requests sent: {self.requests} ({statuses})\n"
            f"- 5xx answers: {self.server_errors}\n"
            f"- failed checks (schema violations and others): {len(self.failures)}\n{fails}\n"
            f"- tracebacks in the daemon's log: {self.tracebacks}\n"
            f"- ERROR lines in the daemon's log: {len(self.log_errors)}\n\n{errors}\n"
        )


def read_reports(reports: Path, result: Result) -> None:
    har = reports / "requests.har"
    if har.is_file():
        entries = json.loads(har.read_text())["log"]["entries"]
        result.requests = len(entries)
        result.by_status = Counter(int(e["response"]["status"]) for e in entries)
    events = reports / "events.ndjson"
    seen = set()
    for line in events.read_text().splitlines() if events.is_file() else []:
        for check in _failed_checks(json.loads(line)):
            if check not in seen:
                seen.add(check)
                result.failures.append(check)


def _failed_checks(event: dict[str, Any]) -> Iterator[str]:
    """`check on operation: title (code)` for each failed check a ScenarioFinished event
    holds."""
    recorder = (event.get("ScenarioFinished") or {}).get("recorder") or {}
    for checks in (recorder.get("checks") or {}).values():
        for check in checks:
            if check.get("status") != "success":
                failure = (check.get("failure_info") or {}).get("failure") or {}
                yield (
                    f"{check.get('name')} on {recorder.get('label')}:"
                    f" {failure.get('title', check.get('status'))} ({failure.get('code', '?')})"
                )


def run(args: argparse.Namespace) -> tuple[Result | None, schema_corpus.CorpusResult | None]:
    work = Path(tempfile.mkdtemp(prefix="strata-fuzz-"))
    reports = work / "reports"
    config = CONFIG.format(context=args.context, threads=args.threads)
    result, corpus = None, None
    with daemon(args.model, work, config) as url:
        if args.openapi:
            cmd = schemathesis_cmd(url, args, reports)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_time + 600)
            (work / "schemathesis.out").write_text(proc.stdout + proc.stderr)
            shown = " ".join(["schemathesis", *cmd[3:]]).replace(url, "http://127.0.0.1:PORT")
            shown = shown.replace(str(reports), "REPORTS")
            result = Result(shown, proc.returncode, time.monotonic() - t0)
        if args.schemas:
            corpus = schema_corpus.run(url, max_tokens=args.schema_max_tokens)
    log = (work / "stratad.log").read_text(errors="replace")
    if result is not None:
        read_reports(reports, result)
        result.tracebacks = log.count("Traceback (most recent call last)")
        result.log_errors = [line for line in log.splitlines() if " ERROR " in line]
    if corpus is not None:
        corpus.tracebacks = log.count("Traceback (most recent call last)")
    print(f"daemon log, schemathesis output and reports: {work}", file=sys.stderr)
    return result, corpus


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.http.fuzz_api",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: stratad's default model)")
    p.add_argument("--max-examples", type=int, default=40, help="test cases per operation")
    p.add_argument("--max-time", type=int, default=600, help="time budget of the run, seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--checks", default=CHECKS, help="schemathesis checks (comma-separated)")
    p.add_argument("--context", type=int, default=256, help="the daemon's model.max_context")
    p.add_argument("--threads", type=int, default=1, help="the daemon's engine.threads")
    p.add_argument("--schemas", action="store_true",
                   help="send the hostile JSON schema corpus too (bench/http/schema_corpus.py)")
    p.add_argument("--no-openapi", dest="openapi", action="store_false",
                   help="skip schemathesis (with --schemas: the corpus alone)")
    p.add_argument("--schema-max-tokens", type=int, default=48,
                   help="max_tokens of each corpus request")
    p.add_argument("--out", type=Path, help="write the Markdown summary here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result, corpus = run(args)
    text = (
        f"# API fuzz run, {datetime.date.today().isoformat()}\n\n"
        f"stratad on {args.model or 'the default model'}, loopback, model.max_context ="
        f" {args.context}, server.default_max_tokens = 8.\n"
    )
    clean = True
    if result is not None:
        text += f"\n## OpenAPI (schemathesis)\n\n{result.markdown()}"
        clean = result.server_errors == 0 and not result.failures and result.tracebacks == 0
        clean = clean and result.exit_code == 0
    if corpus is not None:
        text += f"\n## JSON schema corpus\n\n{corpus.markdown()}"
        clean = clean and corpus.clean
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if clean else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
