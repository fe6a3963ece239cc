"""The gated delta rule's kernel forms on one prefill chunk, at Qwen3-Next-80B's shapes.

    python -m bench.gpu.delta_rule --tokens 4096 --repeats 5

Times `kernels.layers.delta_rule.gated_delta_rule` over --tokens tokens of 16 key heads and
32 value heads of 128 dims (bf16 projections, as a layer hands them over): token by token,
and chunked with the products in float32 ("ieee") and, where the hardware has it, "tf32x3".
Printed per form: the median ms of a launch with the spread, and the largest difference of
its output and state from the token-by-token form's. A chunk of 4,096 tokens of the model
runs the rule in 36 layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from kernels.layers.delta_rule import DeltaRuleConfig, gated_delta_rule

HK, HV, D = 16, 32, 128


def run(tokens: int, repeats: int, forms: list[str]) -> dict[str, dict[str, object]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    mixed = torch.randn(tokens, 2 * HK * D + HV * D, device=dev, generator=g).bfloat16()
    q, k, v = mixed.split([HK * D, HK * D, HV * D], dim=-1)
    ba = torch.randn(tokens, 2 * HV, device=dev, generator=g).bfloat16()
    dt_bias = torch.randn(HV, device=dev, generator=g)
    a = -torch.rand(HV, device=dev, generator=g)
    state0 = torch.randn(HV, D, D, device=dev, generator=g) * 0.1
    args = (q.view(tokens, HK, D), k.view(tokens, HK, D), v.view(tokens, HV, D), ba, dt_bias, a)
    base = DeltaRuleConfig()
    configs = {
        "token": replace(base, chunk_from=tokens + 1),
        "chunked-ieee": replace(base, chunk_from=1, precision="ieee"),
        "chunked-tf32x3": replace(base, chunk_from=1, precision="tf32x3"),
    }
    out: dict[str, dict[str, object]] = {}
    ref = None
    for name in forms:
        cfg = configs[name]
        state = state0.clone()
        o = gated_delta_rule(*args, state, cfg)  # compile
        if ref is None:
            ref = (o, state)
        times = []
        for _ in range(repeats):
            state = state0.clone()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            o = gated_delta_rule(*args, state, cfg)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = {
            "ms": statistics.median(times), "spread": [min(times), max(times)],
            "max_diff_out": float((o - ref[0]).abs().max()),
            "max_diff_state": float((state - ref[1]).abs().max()),
        }  # fmt: skip
        print(f"{name}: {out[name]['ms']:.3f} ms ({min(times):.3f}-{max(times):.3f}), output"
              f" within {out[name]['max_diff_out']:.2e}, state within"
              f" {out[name]['max_diff_state']:.2e} of the token form")  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--forms", default="token,chunked-ieee,chunked-tf32x3")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    out = run(args.tokens, args.repeats, args.forms.split(","))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
