"""Constrained decoding through llguidance: a grammar's mask of allowed tokens, step by step.

A job's grammar (llguidance's JSON form, built by the server from `response_format` or a
forced tool call) is checked against the model's vocabulary when the job is prepared
(`check`), then each sequence that has one holds a `Constraint`: before every draw it gives the
tokens the grammar allows next, after it takes the drawn token. Once the grammar is complete
only the end-of-sequence tokens are allowed, so the reply ends there.
"""

from __future__ import annotations

import threading
import weakref

import llguidance
import numpy as np
import torch

from stratad.grammars import LIMITS, matcher_error, probe
from stratad.model.text.tokenizer import Tokenizer

_LOCK = threading.Lock()
_BRIDGES: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = (
    weakref.WeakKeyDictionary()
)


def bridge(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (built once per tokenizer: about 0.5 s)."""
    with _LOCK:
        found = _BRIDGES.get(tokenizer)
        if found is None:
            found = llguidance.LLTokenizer(
                tokenizer.hf.to_str(),
                n_vocab=tokenizer.vocab_size,
                eos_token=sorted(tokenizer.eos_ids),
            )
            _BRIDGES[tokenizer] = found
        return found


def check(tokenizer: Tokenizer, grammar: str) -> str | None:
    """Why `grammar` cannot constrain this model (None: it can): `stratad.grammars.probe`, in
    this process (the daemon runs it in a child: `stratad.runtime.grammar_check`)."""
    return probe(bridge(tokenizer), grammar, tokenizer.eos_ids, tokenizer.vocab_size)


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, tokenizer: Tokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(bridge(tokenizer), grammar, log_level=0, limits=LIMITS)
        self.vocab = tokenizer.vocab_size
        if self.matcher.is_error():
            raise ValueError(f"the grammar failed: {matcher_error(self.matcher)}")

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            why = matcher_error(self.matcher)
            raise RuntimeError(f"the grammar refused a token it allowed: {why}")
