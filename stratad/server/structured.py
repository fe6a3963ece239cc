"""Grammars for structured output, built from the request (llguidance's JSON form; no torch).

`response_format` `json_object` allows any JSON object, `json_schema` the schema's instances
(`strict` or not: both are enforced). JSON is written compactly (no free whitespace), so that
a small model cannot spend its tokens on blank lines. llama-server's `grammar` field is GBNF
(llama.cpp's grammar format), converted to Lark by llguidance's own converter. The engine checks
the grammar against the model's vocabulary and masks each draw with it
(`stratad.runtime.grammar`).
"""

from __future__ import annotations

from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from stratad.grammars import LIMITS, too_large
from stratad.server.openai.requests import RequestError, ResponseFormat

_JSON_OPTIONS: Any = {"whitespace_flexible": False}


def json_grammar(schema: dict[str, Any], param: str) -> str:
    """The grammar of `schema`'s instances; RequestError naming `param` if it is not one (or
    is too large to follow: `stratad.grammars`)."""
    why = too_large(schema)
    if why is not None:
        raise RequestError(f"{param} is too large a JSON schema: {why}", param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise RequestError(f"{param} is not a usable JSON schema: {e}", param) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
    if failed:
        raise RequestError(f"{param} is not a usable JSON schema: {'; '.join(messages)}", param)
    return grammar


def response_grammar(fmt: ResponseFormat | None) -> str | None:
    """The grammar `response_format` asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if fmt.json_schema is None:
        raise RequestError(
            "response_format of type json_schema needs json_schema", "response_format.json_schema"
        )
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
    return json_grammar(schema, "response_format.json_schema.schema")


def gbnf_grammar(text: str, param: str) -> str:
    """The grammar of a GBNF text (Lark, as llguidance reads it, passes as it is);
    RequestError naming `param` if it is not a grammar. Whether it can be followed is left to
    the engine's check, in a process of its own: Lark may embed JSON schemas (`%json`) that
    no bound here has seen, and one crashed llguidance's compiler (stratad/grammars.py)."""
    try:
        return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(text)))
    except Exception as e:  # the converter raises plain Exceptions ("Rule 'x' not found")
        raise RequestError(f"{param} is not a valid GBNF grammar: {e}", param) from None
