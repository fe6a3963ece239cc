"""OpenAI's embeddings route, `POST /v1/embeddings`: its request and answer schemas, and its
steps (those of every completion route, `Completions.serve`: decode, queue, answer).

Each input is a job of its own (`Job.embed`), queued in turn like the choices of a completion.
The engine computes the input as a prompt and pools the final norm's output of its tokens as
`server.embeddings` says (`mean`, or the `last` token's), L2-normalised: one vector of the
model's width. `encoding_format: "base64"` carries the vector's float32 little-endian bytes,
as OpenAI's does (its Python client asks for that by default and decodes it).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

import msgspec
from aiohttp import web

from stratad.runtime.jobs import Embed, Job, PoolingKind
from stratad.runtime.scheduler import Backend, Ticket
from stratad.server import fields
from stratad.server.completions import Completions
from stratad.server.errors import error_response
from stratad.server.finished import Unfinished, deltas_of
from stratad.server.openai.requests import RequestError, TokenIds, prompts_of
from stratad.server.validation import decode_json

MAX_INPUTS = 2048  # inputs per request, as OpenAI's


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


# One input (text, or token ids), or a list of inputs (texts, or lists of token ids); the
# list's items are checked by `prompts_of`, as a completion's prompts are.
Input = (
    Annotated[str, msgspec.Meta(min_length=1)]
    | Annotated[list[str | int | TokenIds], msgspec.Meta(min_length=1)]
)


class EmbeddingRequest(_Struct, frozen=True):
    input: Input
    """a text, a list of token ids, or a list of either (at most 2048); none may be empty"""
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    """default float; base64: the float32 little-endian bytes of each vector"""
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """only the model's width: a vector is not shortened"""
    user: str | None = None


class Embedding(_Struct, frozen=True):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str
    """the vector, or its float32 little-endian bytes in base64"""


class EmbeddingUsage(_Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Struct, frozen=True):
    """The inputs' embeddings, in their order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


_FIELDS = fields.known_fields(EmbeddingRequest)


def embedding_jobs(req: EmbeddingRequest, pooling: PoolingKind) -> list[Job]:
    """One job per input, in order."""
    inputs = prompts_of(req.input, "input")
    if len(inputs) > MAX_INPUTS:
        raise RequestError(f"input has {len(inputs)} items; at most {MAX_INPUTS}", "input")
    embed = Embed(pooling=pooling, dimensions=req.dimensions)
    jobs = []
    for i, one in enumerate(inputs):
        if one == "":  # its tokens would be the model's special ones alone
            raise RequestError(f"input[{i}] is an empty string", "input")
        text = one if isinstance(one, str) else None
        ids = None if isinstance(one, str) else one
        jobs.append(Job(prompt=text, prompt_ids=ids, max_tokens=None, embed=embed))
    return jobs


def encoded(vector: bytes, base64_bytes: bool) -> list[float] | str:
    if base64_bytes:
        return base64.b64encode(vector).decode()
    return list(struct.unpack(f"<{len(vector) // 4}f", vector))


class Embeddings:
    """The route, on the completions' queue and steps; `pooling` is `server.embeddings`."""

    def __init__(self, completions: Completions, pooling: Literal["off"] | PoolingKind) -> None:
        self.completions = completions
        self.pooling = pooling

    async def create(self, request: web.Request) -> web.StreamResponse:
        pooling = self.pooling
        if pooling == "off":
            return error_response(
                501, "embeddings are off on this server (server.embeddings)", None,
                kind="not_supported_error",
            )  # fmt: skip

        def decode(body: bytes) -> tuple[EmbeddingRequest, list[Job]]:
            req = decode_json(body, EmbeddingRequest)
            fields.check(body, _FIELDS)
            return req, embedding_jobs(req, pooling)

        return await self.completions.serve(request, decode, self._answer)

    async def _answer(
        self, request: web.Request, req: EmbeddingRequest, engine: Backend, tickets: list[Ticket]
    ) -> web.Response:
        try:
            lasts = [(await deltas_of(t))[-1] for t in tickets]
        except Unfinished as e:
            for t in tickets:
                t.cancel()
            return e.response
        data = []
        for i, d in enumerate(lasts):
            assert d.embedding is not None, "an embedding job answered without its vector"
            vector = encoded(d.embedding, req.encoding_format == "base64")
            data.append(Embedding(object="embedding", index=i, embedding=vector))
        tokens = sum(d.prompt_tokens for d in lasts)
        body = EmbeddingList(
            object="list",
            data=data,
            model=engine.model_id,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")
