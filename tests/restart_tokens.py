"""One start of the default engine and its greedy tokens, printed as JSON: what
tests/test_restarts.py runs ten times, each in a process of its own.

    python -m tests.restart_tokens THREADS

The engine is opened as stratad opens it (`open_runner` on a config: the cpu engine on the
packaged SmolLM2, the kernels' largest team `engine.cpu_expert_threads = THREADS`), then
answers each prompt alone and all of them as one batch (one decode call of several rows),
greedily. Printed per answer: the token ids, and a digest of every step's logits (bits, not
rounded), so a sum whose order follows the team size shows even where the argmax holds; and
the team sizes the one-token calls were timed on.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from kernels.cpu.build import quiet_openmp

quiet_openmp()  # as stratad's entry point, before torch loads

from kernels.cpu.dense import DenseStack  # noqa: E402
from stratad.config import parse_config  # noqa: E402
from stratad.engine.batch import Seq  # noqa: E402
from stratad.engine.runner import open_runner  # noqa: E402
from stratad.model.text.tokenizer_build import load_tokenizer  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
)
TOKENS = 16  # decode steps per answer: 80 one-token calls alone (cpu_team tries every 32)

CONFIG = """
[engine]
device = "cpu"
backend = "cpu"
cpu_expert_threads = {threads}
"""


def main(threads: int) -> dict[str, Any]:
    runner = open_runner(parse_config(CONFIG.format(threads=threads)))
    tok = load_tokenizer(runner.model)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]

    def answer(batch: list[list[int]]) -> list[list[int | str]]:
        caches = [runner.new_cache(len(p) + TOKENS + 1) for p in batch]
        logits = runner.step([Seq(c, p) for c, p in zip(caches, batch, strict=True)])
        out: list[list[int | str]] = [[] for _ in batch]
        digest = [hashlib.sha256() for _ in batch]
        for _ in range(TOKENS):
            nxt = []
            for b, lg in enumerate(logits):
                digest[b].update(lg.float().contiguous().numpy().tobytes())
                nxt.append(int(lg[-1].argmax()))
                out[b].append(nxt[-1])
            logits = runner.step([Seq(c, [t]) for c, t in zip(caches, nxt, strict=True)])
        return [o + [d.hexdigest()[:16]] for o, d in zip(out, digest, strict=True)]

    alone = [answer([p])[0] for p in prompts]
    batch = answer(prompts)
    stack = getattr(runner.forward, "stack", None)
    teams = stack.team.measured(1) if isinstance(stack, DenseStack) else []
    return {"alone": alone, "batch": batch, "teams": teams}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
