"""Bounds on the grammars a request may bring (llguidance's JSON form; no torch), and the
check that a grammar can start (`probe`), run where the caller likes (in a child process
for the daemon: `stratad.runtime.grammar_check`).

A client's schema becomes a grammar the server compiles and the engine follows token by token;
both take time and memory that grow with the schema. These bounds make an oversized or
unfollowable schema the client's 400, found before generation, in bounded time: at most
`MAX_PROPERTIES` object properties and `MAX_NODES` schema nodes (OpenAI's structured outputs
allow 5,000 properties) nested at most `MAX_DEPTH` deep (a template writes a tool's schema
recursively), number bounds within +-2^53 (`MAX_BOUND`), and llguidance's own parser limits
(`LIMITS`), with terse errors (verbose ones print the parser's state, which can hold the
schema).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import llguidance
import numpy as np

MAX_PROPERTIES = 5_000
MAX_NODES = 50_000
MAX_DEPTH = 64
# llguidance holds a number's bounds as float64 and an integer's as int64: past 2^53 a bound is
# not kept exactly, past 2^63 it is clamped (`minimum: 1e300` allowed 2^63 - 1, outside the
# schema), and an integer range clamped to -2^63 at both ends crashed the process (SIGSEGV)
MAX_BOUND = 2**53
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
VALUES = ("enum", "const", "default", "examples")  # instances, not schemas: not searched
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
PROBE_STEPS = 8  # free choices a check makes into a grammar (forced text costs none)


def schema_size(schema: Any) -> tuple[int, int, int]:
    """(object properties, nodes, depth) of a JSON schema, counted without recursion (a schema
    may nest deeper than Python's stack)."""
    properties = nodes = deepest = 0
    todo = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        nodes += 1
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return properties, nodes, deepest


def far_bound(schema: Any) -> str | None:
    """The first number bound of `schema` past +-MAX_BOUND, as `keyword value` (None: none
    is), found without recursion."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in BOUNDS:
                v = node.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > MAX_BOUND:
                    text = repr(v)
                    return f"{key} {text if len(text) <= 24 else text[:20] + '...'}"
            todo.extend(v for k, v in node.items() if k not in VALUES)
        elif isinstance(node, list):
            todo.extend(node)
    return None


def too_large(schema: Any) -> str | None:
    """Why `schema` is too large to compile (None: it is not)."""
    far = far_bound(schema)
    if far is not None:
        return f"{far} is beyond +-2^53, past which a bound is not kept exactly"
    properties, nodes, depth = schema_size(schema)
    if properties > MAX_PROPERTIES:
        return f"{properties:,} object properties (at most {MAX_PROPERTIES:,})"
    if nodes > MAX_NODES:
        return f"{nodes:,} schema nodes (at most {MAX_NODES:,})"
    if depth > MAX_DEPTH:
        return f"nested {depth:,} deep (at most {MAX_DEPTH})"
    return None


def probe(
    lexicon: llguidance.LLTokenizer, grammar: str, eos: Collection[int], vocab: int
) -> str | None:
    """Why `grammar` cannot constrain a model of this vocabulary (None: it can). Beyond
    validating it, the first steps are taken: the text the grammar forces (a forced tool
    call's opening) at once, then the first token allowed, up to PROBE_STEPS choices or the
    end. A grammar that cannot start (a required cycle of `$ref`s, a pattern whose lexer
    outgrows its limits, a row of too many items) fails here, before generation, not at the
    request's first sampled tokens."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, lexicon, limits=LIMITS
    )
    if failed:
        return "; ".join(messages)
    m = llguidance.LLMatcher(lexicon, grammar, log_level=0, limits=LIMITS)
    for _ in range(PROBE_STEPS):
        if m.is_error():
            return matcher_error(m)
        forced = m.compute_ff_tokens()
        if forced and not m.is_error():
            m.consume_tokens(forced)
        if m.is_error():
            return matcher_error(m)
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].nonzero()[0]
        if m.is_error():
            return matcher_error(m)
        if allowed.size == 0:
            return "it allows no token here"
        first = int(allowed[0])
        if first in eos or m.is_stopped():
            return None  # it may end here
        m.consume_token(first)
    return matcher_error(m) if m.is_error() else None


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error in one line (terse errors end in a marker of their own)."""
    return str(matcher.get_error()).replace("<non-verbose/>", "").strip()
