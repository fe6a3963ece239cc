"""OpenAI request schemas (msgspec) and their translation into engine `Job`s."""

from __future__ import annotations

from typing import Annotated

import msgspec

from stratad.jobs import ChatMessage, Job

ROLES = ("system", "user", "assistant")


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    model: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


def to_job(req: ChatCompletionRequest) -> Job:
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise msgspec.ValidationError(
                f"unknown role {m.role!r} (expected one of {', '.join(ROLES)}) - at `$.messages[{i}].role`"
            )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return Job(
        messages=tuple(ChatMessage(m.role, m.content) for m in req.messages),
        max_tokens=req.max_completion_tokens or req.max_tokens or 256,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop=stop,
    )


def error_body(message: str, kind: str, param: str | None) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": None}}
    )
