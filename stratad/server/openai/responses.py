"""OpenAI response schemas (msgspec): completions and their chunks, usage, log-probabilities,
the model list and the error body. The requests and their translation into engine jobs are
`stratad.server.openai.requests`'s.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stratad.runtime import jobs
from stratad.server.llama.timings import Timings
from stratad.server.tools import types as tt


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class PromptTokensDetails(_Struct, frozen=True):
    cached_tokens: int


class Usage(_Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class AssistantMessage(_Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    """null when the reply is tool calls only"""
    tool_calls: list[tt.ToolCall] | None = None
    reasoning_content: str | None = None
    """the reply's reasoning, where the model writes it apart (gpt-oss's analysis channel)"""


class TopLogprob(_Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Struct, frozen=True):
    """A chat choice's log-probabilities, one entry per generated token."""

    content: list[TokenLogprob] | None


def chat_logprobs(tokens: list[jobs.TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.bytes),
                top_logprobs=[
                    TopLogprob(token=a.token, logprob=a.logprob, bytes=list(a.bytes))
                    for a in t.top
                ],
            )
            for t in tokens
        ]
    )


class CompletionLogprobs(_Struct, frozen=True):
    """The legacy completions form: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


def completion_logprobs(tokens: list[jobs.TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """`offset`: where the first token starts in the completion's text (streaming)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(
        tokens=[t.token for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{a.token: a.logprob for a in t.top} for t in tokens],
        text_offset=offsets,
    )


class ChatChoice(_Struct, frozen=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Struct, frozen=True, omit_defaults=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings | None = None
    """llama-server's, when the request sets `timings_per_token`"""


class ChunkDelta(_Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[tt.ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChunkChoice(_Struct, frozen=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Struct, frozen=True, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None
    """llama-server's, when the request sets `timings_per_token`"""


class CompletionChoice(_Struct, frozen=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Struct, frozen=True, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None
    """llama-server's, when the request sets `timings_per_token`"""


class ModelCard(_Struct, frozen=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Struct, frozen=True):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(_Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Struct, frozen=True):
    error: ErrorDetail


def error_body(message: str, kind: str, param: str | None, code: str | None = None) -> bytes:
    return msgspec.json.encode(
        ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    )
