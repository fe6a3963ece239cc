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

from stratad.grammars import LIMITS
from stratad.model.tokenizer import Tokenizer

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


PROBE_STEPS = 8  # free choices a check makes into a grammar (forced text costs none)


def check(tokenizer: Tokenizer, grammar: str) -> str | None:
    """Why `grammar` cannot constrain this model (None: it can). Beyond validating it, the
    first steps are taken: the text the grammar forces (a forced tool call's opening) at
    once, then the first token allowed, up to PROBE_STEPS choices or the end. A grammar that
    cannot start (a required cycle of `$ref`s, a pattern whose lexer outgrows its limits, a
    row of too many items) fails here, before generation, not at the request's first
    sampled tokens."""
    lexicon = bridge(tokenizer)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, lexicon, limits=LIMITS
    )
    if failed:
        return "; ".join(messages)
    probe = Constraint(tokenizer, grammar)
    m = probe.matcher
    for _ in range(PROBE_STEPS):
        forced = m.compute_ff_tokens()
        if forced and not m.is_error():
            m.consume_tokens(forced)
        if m.is_error():
            return _error(m)
        allowed = probe.allowed().nonzero()
        if m.is_error():
            return _error(m)
        if allowed.numel() == 0:
            return "it allows no token here"
        first = int(allowed[0])
        if first in tokenizer.eos_ids or m.is_stopped():
            return None  # it may end here
        m.consume_token(first)
        if m.is_error():
            return _error(m)
    return None


def _error(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error in one line (terse errors end in a marker of their own)."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, tokenizer: Tokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(bridge(tokenizer), grammar, log_level=0, limits=LIMITS)
        self.vocab = tokenizer.vocab_size
        if self.matcher.is_error():
            raise ValueError(f"the grammar failed: {_error(self.matcher)}")

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused a token it allowed: {_error(self.matcher)}")
