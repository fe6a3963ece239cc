"""`POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP.

The bodies are those of llama-server and vLLM, so scripts written for either work here:

    /tokenize    {"content": "..."} (llama-server; no BOS unless "add_special": true)
                 {"prompt": "..."} (vLLM; BOS as the model asks, unless
                   "add_special_tokens": false)
                 {"messages": [...]} (vLLM; the chat template, "add_generation_prompt" true)
              -> {"tokens": [...], "count": N, "max_model_len": C}
                 ("with_pieces": true gives [{"id": i, "piece": "..."}] instead of ids)
    /detokenize  {"tokens": [...]} -> {"content": "...", "prompt": "..."} (the same text under
                 llama-server's and vLLM's key)

The tokenizer runs on worker threads (it lets go of the GIL), never on the event loop. No
torch here: the engine's tokenizer is reached through the `TextCodec` protocol.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Protocol

import msgspec
from aiohttp import web

from stratad.server.errors import error_response, param_of
from stratad.server.validation import decode_json

TOKENIZER_THREADS = 2


class TextCodec(Protocol):
    """What these routes need of the engine's tokenizer
    (`stratad.model.text.tokenizer.Tokenizer`)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special: bool = True) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = False) -> str: ...

    def token_text(self, token_id: int) -> str: ...


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class TokenizeMessage(_Struct, frozen=True, kw_only=True):
    role: str
    content: str


class TokenizeRequest(_Struct, frozen=True, kw_only=True):
    """Exactly one of `content`, `prompt` and `messages`."""

    model: str | None = None
    content: str | None = None
    """the text (llama-server); no BOS unless `add_special`"""
    prompt: str | None = None
    """the text (vLLM); BOS as the model asks, unless `add_special_tokens` is false"""
    messages: list[TokenizeMessage] | None = None
    """a conversation, formatted by the chat template"""
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    with_pieces: bool = False


class TokenPiece(_Struct, frozen=True, kw_only=True):
    id: int
    piece: str


class TokenizeResponse(_Struct, frozen=True, kw_only=True):
    """The token ids, their number and the context they must fit."""

    tokens: list[int | TokenPiece]
    """ids, or with `with_pieces` each id with its text"""
    count: int
    max_model_len: int


TokenId = Annotated[int, msgspec.Meta(ge=0)]


class DetokenizeRequest(_Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Struct, frozen=True, kw_only=True):
    """The text the ids stand for."""

    content: str
    """the text (llama-server's key)"""
    prompt: str
    """the same text (vLLM's key)"""


class _BadRequest(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def tokenize(codec: TextCodec, req: TokenizeRequest) -> list[int]:
    given = [k for k in ("content", "prompt", "messages") if getattr(req, k) is not None]
    if len(given) != 1:
        raise _BadRequest("give exactly one of content, prompt and messages", None)
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            return codec.encode_chat(messages, req.add_generation_prompt)
        except ValueError as e:  # the template refused the conversation
            raise _BadRequest(str(e), "messages") from None
    special = req.add_special if req.add_special is not None else req.add_special_tokens
    if special is None:
        special = req.prompt is not None  # each server's own default
    return codec.encode(req.content if req.content is not None else req.prompt or "", special)


def detokenize(codec: TextCodec, ids: list[int]) -> str:
    for i, t in enumerate(ids):
        if t >= codec.vocab_size:
            raise _BadRequest(f"token {t} is not in the vocabulary of {codec.vocab_size}",
                              f"tokens[{i}]")  # fmt: skip
    return codec.decode(ids)


class TokenRoutes:
    """The two handlers; `codec` and `max_context` are set once the model has loaded."""

    def __init__(self, body_timeout_s: float) -> None:
        self.body_timeout_s = body_timeout_s
        self.codec: TextCodec | None = None
        self.max_context = 0
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def _body(self, request: web.Request, kind: type[Any]) -> Any:
        try:
            body = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except TimeoutError:
            raise _BadRequest(f"the request body did not arrive within {self.body_timeout_s:g}"
                              " s (server.body_timeout_s)", None) from None  # fmt: skip
        try:
            return decode_json(body, kind)
        except msgspec.ValidationError as e:
            raise _BadRequest(str(e), param_of(str(e))) from None
        except (msgspec.DecodeError, RecursionError):
            raise _BadRequest("the body is not valid JSON", None) from None

    async def _answer(self, request: web.Request, kind: type[Any], work: Any) -> web.Response:
        codec = self.codec
        if codec is None:
            return error_response(503, "the model is not loaded yet", None, retry_after=1)
        try:
            req = await self._body(request, kind)
            loop = asyncio.get_running_loop()
            body = await loop.run_in_executor(self._pool, work, codec, req)
        except _BadRequest as e:
            return error_response(400, str(e), e.param)
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, TokenizeRequest, self._tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, DetokenizeRequest, self._detokenize)

    def _tokenize(self, codec: TextCodec, req: TokenizeRequest) -> TokenizeResponse:
        ids = tokenize(codec, req)
        tokens: list[int | TokenPiece] = list(ids)
        if req.with_pieces:
            tokens = [TokenPiece(id=i, piece=codec.token_text(i)) for i in ids]
        return TokenizeResponse(tokens=tokens, count=len(ids), max_model_len=self.max_context)

    def _detokenize(self, codec: TextCodec, req: DetokenizeRequest) -> DetokenizeResponse:
        text = detokenize(codec, req.tokens)
        return DetokenizeResponse(content=text, prompt=text)
