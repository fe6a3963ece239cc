"""Bounds on the grammars a request may bring (llguidance's JSON form; no torch).

A client's schema becomes a grammar the server compiles and the engine follows token by token;
both take time and memory that grow with the schema. These bounds make an oversized or
unfollowable schema the client's 400, found before generation, in bounded time: at most
`MAX_PROPERTIES` object properties and `MAX_NODES` schema nodes (OpenAI's structured outputs
allow 5,000 properties), and llguidance's own parser limits (`LIMITS`), with terse errors
(verbose ones print the parser's state, which can hold the schema).
"""

from __future__ import annotations

from typing import Any

import llguidance

MAX_PROPERTIES = 5_000
MAX_NODES = 50_000
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def schema_size(schema: Any) -> tuple[int, int]:
    """(object properties, nodes) of a JSON schema, counted without recursion (a schema may
    nest deeper than Python's stack)."""
    properties = nodes = 0
    todo = [schema]
    while todo:
        node = todo.pop()
        nodes += 1
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return properties, nodes


def too_large(schema: Any) -> str | None:
    """Why `schema` is too large to compile (None: it is not)."""
    properties, nodes = schema_size(schema)
    if properties > MAX_PROPERTIES:
        return f"{properties:,} object properties (at most {MAX_PROPERTIES:,})"
    if nodes > MAX_NODES:
        return f"{nodes:,} schema nodes (at most {MAX_NODES:,})"
    return None
