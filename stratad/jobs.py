"""What the front ends hand to the engine and get back: plain messages, no torch.

The HTTP server builds a `Job` from a validated request; the engine answers with a stream
of `Delta`s. Both sides import this module; only the engine side imports torch.
"""

from __future__ import annotations

import msgspec


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One completion request. Exactly one of `messages` and `prompt` is set."""

    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    """New text of a running job; the last one carries `finish_reason` and the usage counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class JobError(ValueError):
    """A job the engine refuses (e.g. a prompt longer than the context): a client error."""
