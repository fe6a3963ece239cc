"""The control-socket verbs: status, coverage, plan, stats, profile-save, drain, undrain.

Each prints a readable summary, or the daemon's reply as JSON with --json. Exit codes: 0 fine,
1 the daemon could not be asked (or refused), 3 the answer is "not yet": coverage incomplete
(gate a deploy on it), or a drain that still has requests in flight; `undrain` exits 1 when the
daemon does not take requests again (it was not drained, or it is stopping).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from stratactl.client import (
    DEFAULT_TIMEOUT_S,
    Client,
    ClientError,
    DaemonError,
    add_socket_args,
    duration,
    fail,
    gib,
    print_json,
    socket_path,
)
from stratad.protocol import (
    CoverageReply,
    CoverageRequest,
    DrainReply,
    DrainRequest,
    PlanReply,
    PlanRequest,
    ProfileSaveReply,
    ProfileSaveRequest,
    StatsReply,
    StatsRequest,
    StatusReply,
    StatusRequest,
    UndrainReply,
    UndrainRequest,
)

EXIT_NOT_YET = 3


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    verbs = {
        "status": "state, model, uptime, requests, pinning progress, memory",
        "coverage": "which experts keep a copy in RAM/VRAM, per layer; exit 3 when incomplete",
        "plan": "the residency plan: experts and bytes per tier, budgets, hash",
        "stats": "request counts, tokens, stage timings, tier hit rates",
    }
    for verb, help_text in verbs.items():
        p = subparsers.add_parser(verb, help=help_text, description=help_text)
        add_socket_args(p)
    p = subparsers.add_parser("profile-save", help="write the expert routing profile to a file",
                              description="Ask the daemon to write its expert routing profile.")
    p.add_argument("path", nargs="?", default="",
                   help="file the daemon writes, in the directory of store.expert_profile"
                   " (default: store.expert_profile itself)")
    add_socket_args(p)
    p = subparsers.add_parser(
        "drain", help="finish in-flight requests, refuse new ones (503)",
        description="Stop taking new requests (they get 503 with Retry-After) and let the ones"
        " in flight finish. Exit 0 once none is in flight, 3 if some still are after --wait.",
    )
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for in-flight requests (default: do not wait)")
    add_socket_args(p)
    p = subparsers.add_parser(
        "undrain", help="take new requests again after a drain",
        description="Undo `stratactl drain`: the daemon takes new requests again and /health"
        " answers 200. Refused while the daemon is stopping (after SIGTERM).",
    )
    add_socket_args(p)


def run(args: argparse.Namespace) -> int:
    client = Client(socket_path(args), DEFAULT_TIMEOUT_S + getattr(args, "wait", 0.0))
    try:
        return _VERBS[args.verb](client, args)
    except ClientError as e:
        return fail(str(e))
    except DaemonError as e:
        return fail(f"the daemon refused: {e}" if e.code == "permission" else f"daemon: {e}")


def _status(client: Client, args: argparse.Namespace) -> int:
    r = client.request(StatusRequest(), StatusReply)
    if args.json:
        print_json(r)
        return 0
    print(f"stratad {r.version} (pid {r.pid}): {r.state}, up {duration(r.uptime_s)}")
    if r.health is not None and r.health.reason:
        print(f"  health    {r.health.status}: {r.health.reason}")
    if r.model:
        kind = "MoE" if r.moe else "dense"
        print(f"  model     {r.model} ({r.arch}, {kind}) on {r.device}")
    if r.plan_hash or r.coverage_complete is not None:
        cov = {True: "complete", False: "INCOMPLETE (stratactl coverage)", None: "-"}
        print(f"  plan      {r.plan_hash or '-'}   coverage {cov[r.coverage_complete]}")
    q = r.requests
    print(f"  requests  {q.total} answered, {q.active} active, {q.queued} queued,"
          f" {q.refused} refused")
    if r.pinning is not None:
        p = r.pinning
        print(f"  pinning   {gib(p.done_bytes)} of {gib(p.total_bytes)} ({100 * p.fraction:.0f}%),"
              f" {p.rate_bytes_s / 2**30:.2f} GiB/s, ETA {duration(p.eta_s)}")
    m = r.memory
    vram = "-"
    if m.vram_total_bytes is not None:
        vram = f"{gib(m.vram_used_bytes)} of {gib(m.vram_total_bytes)}"
    print(f"  memory    RSS {gib(m.rss_bytes)}, pinned {gib(m.pinned_bytes)}, host"
          f" {gib(m.host_available_bytes)} available of {gib(m.host_total_bytes)}, VRAM {vram}")
    return 0


def format_coverage(r: CoverageReply) -> list[str]:
    if not r.moe:
        return ["coverage: the model has no routed experts (dense): nothing to cover"]
    share = r.in_ram / r.experts if r.experts else 1.0
    covered = r.experts - r.in_file_only
    lines = [
        f"coverage: {covered} of {r.experts} experts keep a copy in RAM or VRAM"
        f" ({100 * covered / max(r.experts, 1):.1f}%; {r.in_ram} in RAM = {100 * share:.1f}%,"
        f" {r.in_vram} in VRAM), {100 * r.routed_mass:.1f}% of the routed mass",
    ]
    file = r.file or "the file"
    if r.complete:
        lines.append(f"  complete: no routed expert is read from {file}")
    else:
        lines.append(f"  INCOMPLETE: {r.in_file_only} experts are read from {file} when routed")
        if r.estimated_cost:
            lines.append(f"  estimated cost: {r.estimated_cost}")
    lines.append(f"  file reads so far: {r.file_reads} ({gib(r.file_read_bytes)})")
    if r.layers:
        lines.append(f"  {'layer':>5} {'experts':>7} {'vram':>5} {'ram':>5} {'file':>5}"
                     f" {'routed mass':>11}")
        for c in r.layers:
            lines.append(f"  {c.layer:>5} {c.experts:>7} {c.in_vram:>5} {c.in_ram:>5}"
                         f" {c.file_only:>5} {100 * c.routed_mass:>10.1f}%")
    return lines


def _coverage(client: Client, args: argparse.Namespace) -> int:
    r = client.request(CoverageRequest(), CoverageReply)
    if args.json:
        print_json(r)
    else:
        print("\n".join(format_coverage(r)))
    return 0 if r.complete else EXIT_NOT_YET


def _plan(client: Client, args: argparse.Namespace) -> int:
    r = client.request(PlanRequest(), PlanReply)
    if args.json:
        print_json(r)
        return 0
    if not r.moe:
        print(f"plan {r.hash}: the model has no routed experts (dense): every weight is loaded")
        return 0
    print(f"plan {r.hash}{' (DEGRADED: smaller than configured)' if r.degraded else ''}")
    for name, tier, budget in (("vram", r.vram, r.vram_budget_bytes),
                               ("ram", r.ram, r.ram_budget_bytes), ("file", r.file, None)):
        limit = f"   budget {gib(budget)}" if budget is not None else ""
        print(f"  {name:<5} {tier.experts:>7} experts {gib(tier.bytes):>12}{limit}")
    print(f"  MemTotal {gib(r.mem_total_bytes)}, headroom {gib(r.headroom_bytes)}")
    for key, value in sorted(r.inputs.items()):
        print(f"  {key}: {value}")
    return 0


def _stats(client: Client, args: argparse.Namespace) -> int:
    r = client.request(StatsRequest(), StatsReply)
    if args.json:
        print_json(r)
        return 0
    print(f"requests {r.requests}, tokens {r.prompt_tokens} prompt + {r.completion_tokens}"
          " completion")
    if r.stages:
        print(f"  {'stage':<16} {'calls':>7} {'total ms':>11} {'mean ms':>9}")
        for s in r.stages:
            print(f"  {s.name:<16} {s.calls:>7} {s.total_ms:>11.1f} {s.mean_ms:>9.2f}")
    if r.tier_hits:
        rates = ", ".join(f"{t} {100 * (r.hit_rate(t) or 0):.1f}%" for t in sorted(r.tier_hits))
        print(f"  expert uses by tier: {rates}")
    c = r.counters
    if c.get("drafted"):
        print(f"  speculative decoding: {c.get('accepted', 0)} of {c['drafted']} drafted tokens"
              f" stood in {c.get('verifies', 0)} verifying steps")  # fmt: skip
    if c.get("preemptions"):
        print(f"  preemptions (the KV pool ran short): {c['preemptions']}")
    return 0


def _profile_save(client: Client, args: argparse.Namespace) -> int:
    r = client.request(ProfileSaveRequest(path=args.path), ProfileSaveReply)
    if args.json:
        print_json(r)
    else:
        print(f"saved the routing profile of {r.experts} experts to {r.path} ({r.bytes} bytes)")
    return 0


def _drain(client: Client, args: argparse.Namespace) -> int:
    r = client.request(DrainRequest(wait_s=args.wait), DrainReply)
    if args.json:
        print_json(r)
    elif r.drained:
        print("drained: no request in flight; new requests get 503 until `stratactl undrain`"
              " or a restart")
    else:
        print(f"draining: {r.in_flight} request(s) still in flight; new requests get 503")
    return 0 if r.drained else EXIT_NOT_YET


def _undrain(client: Client, args: argparse.Namespace) -> int:
    r = client.request(UndrainRequest(), UndrainReply)
    if args.json:
        print_json(r)
    elif r.serving:
        print("undrained: the daemon takes new requests again")
    else:
        print(f"not undrained: the daemon is {r.state}", file=sys.stderr)
    return 0 if r.serving else 1


_VERBS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "status": _status,
    "coverage": _coverage,
    "plan": _plan,
    "stats": _stats,
    "profile-save": _profile_save,
    "drain": _drain,
    "undrain": _undrain,
}
