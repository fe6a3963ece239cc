"""Compile Triton launches for an NVIDIA sm90 GPU on a machine without one (to cubin, with
Triton's bundled tools), so that what only the compiler refuses (a global a kernel reads that
is no constexpr, a dot too small for the tensor cores), or more shared memory than the GPU
has, fails in CI, not on the GPU host.

Run as `python -m tests.sm90_compile CASE` without TRITON_INTERPRET (the interpreter's kernels
do not compile; `compile_case` starts it so): each launch of the case is made with tensors on
the `meta` device (launched as on a GPU, nothing allocated), recorded instead of run, then
compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]  # (kernel, args, kwargs)
SM90_SHARED = 232448  # the most shared memory a block of an H100 or H200 may ask for


def _recorded(module: Any, name: str, call: Callable[[], object]) -> list[Launch]:
    """The launches of `module.name` that `call` makes, recorded (the kernel not run)."""
    kernel, launches = getattr(module, name), []

    class Recorder:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

    setattr(module, name, Recorder())
    try:
        call()
    finally:
        setattr(module, name, kernel)
    return launches


def _compile(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type

    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", bound[p.name]
        else:
            signature[p.name] = mangle_type(bound[p.name])
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    if compiled.metadata.shared > SM90_SHARED:  # (the launch would raise OutOfResources)
        raise RuntimeError(f"{kernel.__name__}: {compiled.metadata.shared} bytes of shared memory,"
                           f" more than sm90's {SM90_SHARED}")  # fmt: skip
    return dict(compiled.asm)


def _attention() -> list[Launch]:
    """Decode attention with gpt-oss's sinks and a window: merged, and one piece."""
    import torch

    from kernels.layers import attention

    meta = torch.device("meta")
    q = torch.empty(2, 8, 64, dtype=torch.bfloat16, device=meta)
    k, v = (torch.empty(2, 70, 2, 64, dtype=torch.bfloat16, device=meta) for _ in "kv")
    lens = torch.empty(2, dtype=torch.int64, device=meta)
    sinks = torch.empty(8, device=meta)
    return [
        launch
        for split_s in (64, 512)
        for launch in _recorded(attention, "_decode_attention_kernel", lambda s=split_s: (
            attention.decode_attention(q, k, v, lens, sinks=sinks, window=9,
                                       config=attention.AttentionConfig(split_s=s))))
    ]  # fmt: skip


def _moe() -> list[Launch]:
    """The fused MoE launches with gpt-oss's biases and clamped SwiGLU (MXFP4 experts)."""
    import torch

    from kernels.experts import moe
    from kernels.formats.quant import QType

    meta = torch.device("meta")
    fmt = moe.ExpertFormat(QType.MXFP4, QType.MXFP4, QType.MXFP4)
    x = torch.empty(2, 256, dtype=torch.bfloat16, device=meta)
    ids = torch.empty(2, 2, dtype=torch.int32, device=meta)
    table = torch.empty(4, 3, dtype=torch.int64, device=meta)
    act = torch.empty(4, 64, device=meta)
    weights = torch.empty(2, 2, device=meta)
    up = torch.empty(4, 2, 64, device=meta)
    down = torch.empty(4, 256, device=meta)
    return [
        *_recorded(moe, "_gate_up_kernel", lambda: moe.moe_gate_up(
            x, ids, table, 64, fmt=fmt, bias=up, clamp=moe.GluClamp())),
        *_recorded(moe, "_down_kernel", lambda: moe.moe_down(
            act, ids, weights, table, 256, fmt=fmt, bias=down)),
    ]  # fmt: skip


def _delta_rule() -> list[Launch]:
    """The gated delta rule over bf16 projections (Qwen3-Next's shapes: 128 dims a head), token
    by token (3 tokens) and chunked (64: the solve, then the chunks); a decode step of 3
    sequences (the convolution, then the rule, each row's state at its own address)."""
    import torch

    from kernels.layers import conv_rows, delta_rule

    meta = torch.device("meta")

    def rule(t: int) -> None:
        mixed = torch.empty(t, 2 * 2 * 128 + 4 * 128, device=meta)
        q, k, v = mixed.split([256, 256, 512], dim=-1)
        ba = torch.empty(t, 8, dtype=torch.bfloat16, device=meta)
        gates = (torch.empty(4, device=meta) for _ in "da")
        state = torch.empty(4, 128, 128, device=meta)
        delta_rule.gated_delta_rule(q.view(t, 2, 128), k.view(t, 2, 128), v.view(t, 4, 128), ba,
                                    *gates, state, cfg)  # fmt: skip

    def rows() -> None:  # a decode step of 3 sequences: the convolution, then the rule
        x = torch.empty(3, 2 * 2 * 128 + 4 * 128, dtype=torch.bfloat16, device=meta)
        table = torch.empty(3, dtype=torch.int64, device=meta)
        out = conv_rows.causal_conv_rows(x, torch.empty(x.shape[1], 4, device=meta), table)
        q, k, v = out.split([256, 256, 512], dim=-1)
        ba = torch.empty(3, 8, dtype=torch.bfloat16, device=meta)
        gates = (torch.empty(4, device=meta) for _ in "da")
        delta_rule.gated_delta_rule_rows(q.view(3, 2, 128), k.view(3, 2, 128), v.view(3, 4, 128),
                                         ba, *gates, table)  # fmt: skip

    cfg = delta_rule.DeltaRuleConfig(precision="tf32x3")  # (what a CUDA build of torch picks)

    chunks: list[Launch] = []
    solve = _recorded(delta_rule, "_delta_rule_solve_kernel", lambda: chunks.extend(
        _recorded(delta_rule, "_delta_rule_chunk_kernel", lambda: rule(64))))  # fmt: skip
    batched: list[Launch] = []
    convs = _recorded(conv_rows, "_conv_rows_kernel", lambda: batched.extend(
        _recorded(delta_rule, "_delta_rule_kernel", rows)))  # fmt: skip
    return [*_recorded(delta_rule, "_delta_rule_kernel", lambda: rule(3)), *solve, *chunks,
            *convs, *batched]  # fmt: skip


def _qlinear() -> list[Launch]:
    """The int8 dense GEMV over each GGUF type it reads, 3 tokens, dp4a as PTX (as on a CUDA
    GPU; the meta device would pick its emulation)."""
    import torch

    from kernels.experts import moe_dots_q8
    from kernels.formats.quant import row_bytes
    from kernels.layers import qlinear

    meta = torch.device("meta")
    x = torch.empty(3, 512, dtype=torch.bfloat16, device=meta)
    launches: list[Launch] = []
    for qtype in sorted(moe_dots_q8.Q8_DOT_QTYPES):
        blocks = torch.empty(8, row_bytes(qtype, 512), dtype=torch.uint8, device=meta)
        _recorded(moe_dots_q8, "_quantize_q8_kernel", lambda b=blocks, q=qtype: launches.extend(
            _recorded(qlinear, "_qlinear_kernel", lambda: qlinear.qlinear(x, b, q))))  # fmt: skip
    return [(kernel, args, kwargs | {"ASM": True}) for kernel, args, kwargs in launches]


CASES = {
    "attention": _attention,
    "moe": _moe,
    "delta_rule": _delta_rule,
    "qlinear": _qlinear,
}


def compile_case(case: str) -> str:
    """Run `python -m tests.sm90_compile case` without the interpreter: its output (it
    raises CalledProcessError, with the compiler's message, if a launch does not compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.sm90_compile", case], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if done.returncode:
        raise AssertionError(f"{case}: a launch does not compile for sm90:\n{done.stderr[-3000:]}")
    return done.stdout


def main(case: str) -> None:
    for kernel, args, kwargs in CASES[case]():
        asm = _compile(kernel, args, kwargs)
        print(f"{kernel.__name__}: {len(asm['cubin'])} bytes of cubin")


if __name__ == "__main__":
    main(sys.argv[1])
