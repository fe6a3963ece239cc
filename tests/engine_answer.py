"""The default daemon's greedy chat reply, computed in process by the engine a CPU host
serves it with (the `cpu` engine: the GGUF blocks read by the compiled CPU kernels), so a
server test checks that the HTTP path returns exactly what the engine computes. The engine
itself is held to llama.cpp in tests/test_cpu_engine.py."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _engine() -> Any:
    from kernels.cpu.experts import CpuExperts
    from stratad.engine.reference.forward import ReferenceForward
    from stratad.engine.reference.weights_mode import QuantWeights
    from stratad.model.default import default_model_path
    from stratad.model.text.tokenizer_build import load_tokenizer
    from stratad.store.loader import load_model

    model = load_model(default_model_path())
    return ReferenceForward(model, weights=QuantWeights(CpuExperts())), load_tokenizer(model)


def greedy_chat(messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, str]:
    """The engine's greedy reply to `messages` from the prompt tokens the daemon's chat
    template gives, up to an end-of-turn token: (text, OpenAI's finish_reason)."""
    forward, tok = _engine()
    prompt = tok.encode_chat(messages)
    cache = forward.new_cache(len(prompt) + max_tokens + 1)
    logits = forward(prompt, cache)[-1]
    out: list[int] = []
    for _ in range(max_tokens):
        t = int(logits.argmax())
        if t in tok.eos_ids:
            return str(tok.decode(out)), "stop"
        out.append(t)
        logits = forward([t], cache)[-1]
    return str(tok.decode(out)), "length"
