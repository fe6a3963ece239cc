"""Bounds on the grammars a request may bring (llguidance's JSON form; no torch).

A client's schema becomes a grammar the server compiles and the engine follows token by token;
both take time and memory that grow with the schema. These bounds make an oversized or
unfollowable schema the client's 400, found before generation, in bounded time: at most
`MAX_PROPERTIES` object properties and `MAX_NODES` schema nodes (OpenAI's structured outputs
allow 5,000 properties) nested at most `MAX_DEPTH` deep (a template writes a tool's schema
recursively), and llguidance's own parser limits (`LIMITS`), with terse errors (verbose ones
print the parser's state, which can hold the schema).
"""

from __future__ import annotations

from typing import Any

import llguidance

MAX_PROPERTIES = 5_000
MAX_NODES = 50_000
MAX_DEPTH = 64
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


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


def too_large(schema: Any) -> str | None:
    """Why `schema` is too large to compile (None: it is not)."""
    properties, nodes, depth = schema_size(schema)
    if properties > MAX_PROPERTIES:
        return f"{properties:,} object properties (at most {MAX_PROPERTIES:,})"
    if nodes > MAX_NODES:
        return f"{nodes:,} schema nodes (at most {MAX_NODES:,})"
    if depth > MAX_DEPTH:
        return f"nested {depth:,} deep (at most {MAX_DEPTH})"
    return None
