"""The OpenAPI 3.1 description of the HTTP API, built from the msgspec schemas it validates with.

The server serves it at /openapi.json; `docs/openapi.json` is the same document, kept in the
repository and rewritten by `python -m stratad.server.openapi docs/openapi.json` (a test checks
that the two agree).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args

import msgspec

from stratad import __version__
from stratad.server import tokens as tk
from stratad.server.anthropic import answers as aa
from stratad.server.anthropic import requests as am
from stratad.server.openai import embeddings as em
from stratad.server.openai import requests as oa
from stratad.server.openai import responses as rs

_REF = "#/components/schemas/{name}"
_TYPES: tuple[Any, ...] = (
    oa.ChatCompletionRequest,
    oa.CompletionRequest,
    rs.ChatCompletion,
    rs.ChatCompletionChunk,
    rs.Completion,
    em.EmbeddingRequest,
    em.EmbeddingList,
    rs.ModelList,
    rs.ErrorResponse,
    oa.Health,
    rs.ModelCard,
    tk.TokenizeRequest,
    tk.TokenizeResponse,
    tk.DetokenizeRequest,
    tk.DetokenizeResponse,
    am.MessagesRequest,
    am.CountTokensRequest,
    aa.MessageResponse,
    aa.CountTokensResponse,
    aa.AnthropicError,
    aa.Event,
)


def _ref(t: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=t.__name__)}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref(rs.ErrorResponse)}},
    }


_ERRORS = {
    "400": _error("Invalid request: the body names the field (`error.param`)."),
    "401": _error("Missing or wrong API key (only when the server has one)."),
    "403": _error("Host header not in the allow-list."),
    "413": _error("Request body larger than server.max_body_bytes."),
    "429": _error("Queue full; retry after the `Retry-After` header's seconds."),
    "503": _error("Loading, draining or failed; retry after `Retry-After` seconds."),
}


def _sse_event(chunk: type) -> dict[str, Any]:
    """One server-sent event of a stream, as a client's SSE parser hands it over: its `data`
    is a JSON `chunk`, or `[DONE]` at the end."""
    return {
        "type": "object",
        "properties": {
            "event": {"type": "string", "const": "message"},
            "data": {
                "anyOf": [
                    {"type": "string", "const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": _ref(chunk)},
                ],
            },
        },
        "required": ["data"],
    }  # fmt: skip


def _completion_op(summary: str, request: type, response: type, chunk: type) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{}, {"bearer": []}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {
                "description": (
                    "The completion; with `stream: true`, server-sent events: one"
                    f" `data: <{chunk.__name__}>` frame per new piece of text, a last chunk"
                    " with `usage` if `stream_options.include_usage`, then `data: [DONE]`."
                ),
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _sse_event(chunk)},
                },
            },
            **_ERRORS,
            "404": _error("`model` names a model this server does not serve (`model_not_found`)."),
        },
    }


def _json_op(summary: str, request: type, response: type) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{}, {"bearer": []}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {
                "description": response.__doc__ or response.__name__,
                "content": {"application/json": {"schema": _ref(response)}},
            },
            **{k: _ERRORS[k] for k in ("400", "401", "413", "503")},
        },
    }


def _embeddings_op() -> dict[str, Any]:
    op = _json_op("Embeddings: each input's pooled hidden state", em.EmbeddingRequest,
                  em.EmbeddingList)  # fmt: skip
    op["responses"].update({
        "404": _error("`model` names a model this server does not serve (`model_not_found`)."),
        "429": _ERRORS["429"],
        "501": _error("Embeddings are off on this server (`server.embeddings`)."),
    })  # fmt: skip
    return op


def _anthropic_op(summary: str, request: type, response: type, stream: bool) -> dict[str, Any]:
    """An operation of Anthropic's Messages API: its errors in Anthropic's shape, its stream
    Anthropic's named events."""
    answer: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
    if stream:
        events = [_ref(t) for t in (*get_args(aa.Event), aa.AnthropicError)]
        answer["text/event-stream"] = {"schema": {
            "type": "object",
            "properties": {
                "event": {"type": "string"},
                "data": {"type": "string", "contentMediaType": "application/json",
                         "contentSchema": {"anyOf": events}},
            },
            "required": ["event", "data"],
        }}  # fmt: skip
    errors = {**_ERRORS, "404": _error("`model` names a model this server does not serve.")}
    shaped = {"application/json": {"schema": _ref(aa.AnthropicError)}}
    return {
        "summary": summary,
        "security": [{}, {"bearer": []}, {"x-api-key": []}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {"description": response.__doc__ or response.__name__, "content": answer},
            **{k: {**v, "content": shaped} for k, v in errors.items()},
        },
    }


def _health() -> dict[str, Any]:
    return {
        "get": {
            "summary": "Readiness (no API key needed)",
            "responses": {
                code: {
                    "description": what,
                    "content": {"application/json": {"schema": _ref(oa.Health)}},
                }
                for code, what in (("200", "Serving."), ("503", "Loading or draining."))
            },
        }
    }


def _rules(components: dict[str, Any]) -> None:
    """The rules across fields that the request types cannot state, written into their
    schemas so that the document says what the server refuses."""
    tokenize = components.get("TokenizeRequest")
    if tokenize is not None:  # exactly one of the three inputs
        tokenize["oneOf"] = [
            {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
            for k in ("content", "prompt", "messages")
        ]
    chat = components.get("ChatCompletionRequest")
    if chat is not None:  # top_logprobs > 0 asks for logprobs
        chat["if"] = {
            "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
            "required": ["top_logprobs"],
        }
        chat["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}


def build_spec() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    _rules(components)
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Strata",
            "version": __version__,
            "description": (
                "OpenAI-compatible completions from stratad, and Anthropic's Messages API."
                " Extensions: `top_k`, `min_p`, and `strata_prefix` (pin a shared prompt"
                " prefix's KV for reuse)."
            ),
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _completion_op(
                    "Chat completion",
                    oa.ChatCompletionRequest,
                    rs.ChatCompletion,
                    rs.ChatCompletionChunk,
                )
            },
            "/v1/completions": {
                "post": _completion_op(
                    "Text completion", oa.CompletionRequest, rs.Completion, rs.Completion
                )
            },
            "/v1/embeddings": {"post": _embeddings_op()},
            "/v1/messages": {
                "post": _anthropic_op("Anthropic's Messages API: a message (`stream`: its events)",
                                      am.MessagesRequest, aa.MessageResponse, stream=True)
            },
            "/v1/messages/count_tokens": {
                "post": _anthropic_op("Anthropic's Messages API: a conversation's prompt tokens",
                                      am.CountTokensRequest, aa.CountTokensResponse, stream=False)
            },
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "security": [{}, {"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "One model.",
                            "content": {"application/json": {"schema": _ref(rs.ModelList)}},
                        },
                        "401": _ERRORS["401"],
                        "503": _ERRORS["503"],
                    },
                }
            },
            "/v1/models/{id}": {
                "get": {
                    "summary": "One served model",
                    "security": [{}, {"bearer": []}],
                    "parameters": [
                        {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": {
                            "description": "The model.",
                            "content": {"application/json": {"schema": _ref(rs.ModelCard)}},
                        },
                        "401": _ERRORS["401"],
                        "404": _error("No served model has this id (`code`: `model_not_found`)."),
                        "503": _ERRORS["503"],
                    },
                }
            },
            "/health": _health(),
            "/v1/health": _health(),
            "/tokenize": {
                "post": _json_op(
                    "Text or a conversation to token ids (llama-server's and vLLM's bodies)",
                    tk.TokenizeRequest,
                    tk.TokenizeResponse,
                )
            },
            "/detokenize": {
                "post": _json_op("Token ids to text", tk.DetokenizeRequest, tk.DetokenizeResponse)
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text exposition format)",
                    "responses": {"200": {"description": "Metrics.", "content": text}},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


def render() -> bytes:
    """The document as stored in docs/openapi.json (sorted keys, two-space indent)."""
    return msgspec.json.format(msgspec.json.encode(build_spec(), order="sorted"), indent=2) + b"\n"


def main(argv: list[str]) -> int:
    data = render()
    if argv:
        Path(argv[0]).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
