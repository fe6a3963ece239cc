"""What the front ends hand to the engine and get back: plain messages, no torch.

The HTTP server builds a `Job` from a validated request; the engine checks and tokenises it
into a `PreparedJob` (off the engine thread) and answers with a stream of `Delta`s. Both sides
import this module; only the engine side imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant message made (as the model wrote it, or a client sent it)."""

    id: str
    name: str
    arguments: str
    """the arguments as JSON text, as OpenAI writes them"""


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """an assistant's calls"""
    tool_call_id: str | None = None
    """a `tool` message: the call it answers"""
    reasoning: str = ""
    """an assistant's earlier reasoning (`reasoning_content`), for templates that write it"""


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call: its name, what it does and its parameters' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


# how an embedding pools its prompt's hidden states: their mean, or the last token's
PoolingKind = Literal["mean", "last"]


class Embed(msgspec.Struct, frozen=True, kw_only=True):
    """What an embedding job asks instead of a completion: its prompt's final-norm hidden
    states pooled into one L2-normalised vector."""

    pooling: PoolingKind = "mean"
    """as `server.embeddings` says"""
    dimensions: int | None = None
    """The vector's length the client asked for; None: the model's width, the only one
    served (checked by the engine)."""


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One completion request, or an embedding (`embed`). Exactly one of `messages`, `prompt`
    and `prompt_ids` is set."""

    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    """A prompt given as token ids (checked against the vocabulary by the engine)."""
    max_tokens: int | None = 256
    """Completion tokens at most; None: whatever the context has room for."""
    fit_max_tokens: bool = False
    """A `max_tokens` the context cannot hold beside the prompt is cut to what it leaves, not
    refused (Anthropic's clients ask for more than a small model's context holds)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, added to its logit) before sampling; ids are checked against the vocabulary
    by the engine."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    """Go on past the model's end-of-sequence tokens, to `max_tokens` or a stop string (what
    load generators ask for, so every request decodes the length they set)."""
    logprobs: int | None = None
    """None: no log-probabilities; k: each token's, with the k likeliest alternatives."""
    tools: tuple[Tool, ...] = ()
    """Functions offered to the model, written into the prompt by the chat template."""
    grammar: str | None = None
    """A grammar (llguidance's JSON form) the output must follow, token by token."""
    grammar_param: str = "response_format"
    """The request field the grammar came from, named if the engine refuses it."""
    prefix_messages: int = 0
    """Pin the KV of the first N messages' tokens (the `strata_prefix` extension)."""
    prefix_tokens: int = 0
    """Pin the KV of the first N prompt tokens (the `strata_prefix` extension)."""
    scope: str = ""
    """Whose cached prefixes it may reuse: a hash of its API key and `user` (the server's
    `cache_scope`); requests of one scope never see another's."""
    embed: Embed | None = None
    """An embedding: the prompt's pooled hidden state instead of a completion (its sampling
    fields unused); None: a completion."""


class PreparedJob(msgspec.Struct, frozen=True, kw_only=True):
    """A job the engine accepted: its prompt tokens, completion budget and pinned prefix."""

    job: Job
    prompt: tuple[int, ...]
    max_tokens: int
    pin: int = 0
    """Leading prompt tokens to keep as a pinned prefix snapshot (0: none)."""
    channels: bool = False
    """The chat template asked for the reply in harmony's channels (gpt-oss): the server reads
    its reasoning, answer and calls apart (`stratad.server.harmony`)."""


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    bytes: bytes
    logprob: float
    id: int = -1
    """the token's id (llama-server's probabilities name it)"""


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token's log-probability and, if asked, the likeliest alternatives."""

    token: str
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    id: int = -1


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    """New text of a running job; the last one carries `finish_reason` and the usage counts."""

    text: str
    logprobs: TokenLogprob | None = None
    """The token this step sampled, if the job asked for logprobs (not the end-of-sequence
    token that stops it)."""
    finish_reason: str | None = None
    stopping_word: str = ""
    """The stop string that ended it (finish_reason "stop" by a stop string, not EOS)."""
    token: int | None = None
    """The token this step sampled (the end-of-sequence token that stops it too)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""
    embedding: bytes | None = None
    """An embedding job's vector, on its one (last) delta: float32 little-endian, the bytes
    OpenAI's base64 encoding carries."""


class JobError(ValueError):
    """A job the engine refuses (e.g. a prompt longer than the context): a client error.

    `param` names the request field at fault and `code` the kind of refusal where OpenAI names
    one (`CONTEXT_LENGTH_EXCEEDED`), for the OpenAI-style error body.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# OpenAI's error code for a prompt, or a prompt and max_tokens, that the context cannot hold
# (LiteLLM and LangChain key on it)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
