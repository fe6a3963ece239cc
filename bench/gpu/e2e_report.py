"""The end-to-end benchmark's report (`bench.gpu.e2e`'s figures as markdown)."""

from __future__ import annotations

import statistics


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.1f} ({min(xs):,.1f}–{max(xs):,.1f})"


def markdown(r: dict) -> str:  # type: ignore[type-arg]
    d = r["decode_tps"]
    lines = [
        f"### expert VRAM {r['expert_vram_gib']} GiB: {r['slots_per_layer']} of "
        f"{r['n_experts']} experts per layer in VRAM",
        "",
        f"- device {r['device']}, torch {r['torch']}; engine start (read + pin experts) "
        f"{r['load_s']:.1f} s; expert blob {r['blob_mib']:.2f} MiB",
        f"- measured: H2D pinned {r['pcie_pinned_gbs']:.1f} GB/s, pageable "
        f"{r['pcie_pageable_gbs']:.1f} GB/s, in-place kernel read {r['inplace_gbs']:.1f} GB/s, "
        f"fetch kernel {r['fetch_gbs']:.1f} GB/s (decode misses: {r['gpu_miss']}"
        + (f", prefetch on {r['prefetch_programs']} programs per blob" if r.get("prefetch") else "")
        + "), "
        f"CPU expert compute {r['cpu_expert_gbs']:.2f} GB/s ({r.get('cpu_math', '-')}; host"
        f" memory read {r.get('host_read_gbs', 0):.1f} GB/s); pcie_frac {r.get('pcie_frac', 1)}"
        f" ({r.get('pcie_frac_setting', '-')})"
        + (f"; link paced to {r['link_gbs']} GB/s ({r['link_wait_ns_per_blob']:,} ns per blob"
           " on top of the fetch kernel's own time)" if r.get("link_gbs") else ""),
        *(
            [f"- RAM holds {c['covered']} of {c['experts']} experts ({c['ram_frac']:.0%} of the"
             f" blobs), the rest read from the file ({c['file_gbs']:.2f} GB/s measured); the"
             f" coverage WARNING predicts up to {c['predicted_prompt_loss']:.0%} less prompt"
             f" speed; {r['file_reads']:,} file reads"]
            if (c := r.get("coverage")) else []
        ),  # fmt: skip
        "",
        "| figure | median (min–max) | ceiling | ratio |",
        "| --- | --- | --- | --- |",
        f"| decode tok/s ({r.get('decode_tokens', 256)} after {r.get('prompt_len', 1024):,})"
        f" | {_spread(d)} | {r['decode_ceiling_both']:,.1f} "
        f"(PCIe alone {r['decode_ceiling_pcie']:,.1f}) | "
        f"{statistics.median(d) / r['decode_ceiling_both']:.0%} |",
        f"| decode hit rate | {r['hit_rate']:.1%} | | |",
        f"| decode MB missed per token | {r['missed_mb_per_token']:,.1f} | | |",
    ]
    if r.get("prefetch"):
        lines.append(f"| decode experts guessed by prefetch | {r['prefetch_guessed']:.1%} | | |")
    for name, stages in (r.get("timing") or {}).items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages.items(), key=lambda x: -x[1]))
        lines.append(f"| stages, {name} (ms) | {parts} | | |")
    for n, p in r["prefill"].items():
        lines.append(
            f"| prefill tok/s at {int(n):,} | {_spread(p['tps'])} | {p['ceiling']:,.0f} "
            f"(PCIe, {p['moved_gb']:.1f} GB moved) | "
            f"{statistics.median(p['tps']) / p['ceiling']:.0%} |"
        )
    for name, rows in (r.get("kernels") or {}).items():
        lines += ["", f"GPU kernels of one {name} (eager, torch.profiler):", "",
                  "| kernel | ms | launches |", "| --- | --- | --- |"]  # fmt: skip
        lines += [f"| {k} | {ms:.3f} | {n:g} |" for k, ms, n in rows]
    return "\n".join(lines) + "\n"
