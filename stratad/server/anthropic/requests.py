"""Anthropic's Messages API: its request schemas (msgspec) and their translation into the
engine's `Job` (the answers: `stratad.server.anthropic.answers`; the routes:
`stratad.server.anthropic.routes`).

A conversation becomes the `ChatMessage`s an OpenAI request would: `system` the first message,
a user turn's `tool_result` blocks `tool` messages, an assistant turn's `tool_use` blocks its
`tool_calls`; the tools become `Tool`s, a forced `tool_choice` the grammar of one call
(`stratad.server.tools.calls`) and `output_config.format` a JSON schema's
(`stratad.server.structured`). What the schemas cannot say (images, a block in the wrong turn)
`messages_job` refuses with `RequestError`, naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from stratad.grammars import too_large
from stratad.runtime import jobs
from stratad.runtime.jobs import ChatMessage, Job
from stratad.server import structured
from stratad.server.openai.requests import (
    MIN_TEMPERATURE,
    MIN_TOP_P,
    TOKENS_MAX,
    RequestError,
    StopString,
    Tokens,
)
from stratad.server.tools import calls as tool_calls
from stratad.server.tools import types as tt

MAX_STOP_SEQUENCES = 16
BLOCK_SEPARATOR = "\n\n"  # between the text blocks of one turn


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


# --- content blocks (tagged by `type`; fields we do not read, as `cache_control`, are ignored)


class TextBlock(_Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class SystemBlock(_Struct, frozen=True):
    """A block of `system`: text only. Not a tagged struct: msgspec requires the tag of a union's
    member only, so a lone `TextBlock` would let a block without its `type` through."""

    type: Literal["text"]
    text: str


class ImageBlock(_Struct, frozen=True, tag="image", tag_field="type"):
    """Refused: the served models read text."""

    source: dict[str, Any] | None = None


class DocumentBlock(_Struct, frozen=True, tag="document", tag_field="type"):
    """Refused: the served models read text."""

    source: dict[str, Any] | None = None


class ToolUseBlock(_Struct, frozen=True, tag="tool_use", tag_field="type"):
    """A call an assistant turn made."""

    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Struct, frozen=True, tag="tool_result", tag_field="type"):
    """What a call gave back, in the user turn after it."""

    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Struct, frozen=True, tag="thinking", tag_field="type"):
    """An earlier turn's reasoning: dropped, as Anthropic drops it from earlier turns."""

    thinking: str = ""


class RedactedThinkingBlock(_Struct, frozen=True, tag="redacted_thinking", tag_field="type"):
    """Dropped, as `thinking`."""

    data: str = ""


Block = (
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
    | RedactedThinkingBlock
)  # fmt: skip


class Turn(_Struct, frozen=True):
    """A message of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[Block]


class ClientTool(_Struct, frozen=True, kw_only=True):
    """A function the model may call (a client tool; Anthropic's server tools, which carry no
    `input_schema`, are refused)."""

    name: tt.FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AutoChoice(_Struct, frozen=True, tag="auto", tag_field="type"):
    """The model decides (the default)."""

    disable_parallel_tool_use: bool | None = None


class AnyChoice(_Struct, frozen=True, tag="any", tag_field="type"):
    """Exactly one call of some tool (the output is constrained to it)."""

    disable_parallel_tool_use: bool | None = None


class NamedChoice(_Struct, frozen=True, tag="tool", tag_field="type"):
    """Exactly one call of the tool `name`."""

    name: str
    disable_parallel_tool_use: bool | None = None


class NoneChoice(_Struct, frozen=True, tag="none", tag_field="type"):
    """No call: the tools are in the prompt, the reply is text."""


ToolChoice = AutoChoice | AnyChoice | NamedChoice | NoneChoice


class JsonFormat(_Struct, frozen=True):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = msgspec.field(name="schema")


class OutputConfig(_Struct, frozen=True):
    format: JsonFormat | None = None
    """the reply is an instance of this JSON schema, token by token"""
    effort: str | None = None
    """accepted; it changes nothing here"""


class Metadata(_Struct, frozen=True):
    user_id: str | None = None
    """who the request is for: its cache scope, as OpenAI's `user`"""


class CountTokensRequest(_Struct, frozen=True):
    """A conversation (`POST /v1/messages/count_tokens`): its prompt's tokens are counted."""

    model: str
    messages: Annotated[list[Turn], msgspec.Meta(min_length=1)]
    system: str | list[SystemBlock] | None = None
    tools: Annotated[list[ClientTool], msgspec.Meta(max_length=tt.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None

    @property
    def user(self) -> str | None:
        return None


class MessagesRequest(CountTokensRequest, frozen=True, kw_only=True):
    """`POST /v1/messages`."""

    max_tokens: Tokens
    """required, as Anthropic's API has it; cut to what the context leaves beside the prompt"""
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    """default 1; 0 is greedy"""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=TOKENS_MAX)] | None = None
    stop_sequences: Annotated[
        list[StopString], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)
    ] | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata is not None else None


# --- the conversation as the engine's messages ---------------------------------------------


def _text(blocks: list[TextBlock | ImageBlock], param: str) -> str:
    for j, b in enumerate(blocks):
        if isinstance(b, ImageBlock):
            raise RequestError("image blocks are not supported (the served model reads text)",
                               f"{param}[{j}]")  # fmt: skip
    return BLOCK_SEPARATOR.join(b.text for b in blocks if isinstance(b, TextBlock))


def _system(system: str | list[SystemBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else BLOCK_SEPARATOR.join(b.text for b in system)
    return [ChatMessage("system", text)] if text else []


def _user(blocks: list[Block], param: str) -> list[ChatMessage]:
    """A user turn: its tool results as `tool` messages and its text as user messages, in
    their order."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{param}[{j}]"
        if isinstance(b, TextBlock):
            texts.append(b.text)
            continue
        if isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
            continue
        if texts:
            out.append(ChatMessage("user", BLOCK_SEPARATOR.join(texts)))
            texts = []
        if isinstance(b, ToolResultBlock):
            content = b.content if b.content is not None else ""
            text = content if isinstance(content, str) else _text(content, f"{at}.content")
            text = f"Error: {text}" if b.is_error else text
            out.append(ChatMessage("tool", text, tool_call_id=b.tool_use_id))
        elif isinstance(b, ToolUseBlock):
            raise RequestError("tool_use blocks belong in assistant turns", at)
        else:
            raise RequestError(
                f"{b.__struct_config__.tag} blocks are not supported (the served model reads"
                " text)", at,
            )  # fmt: skip
    if texts or not out:
        out.append(ChatMessage("user", BLOCK_SEPARATOR.join(texts)))
    return out


def _assistant(blocks: list[Block], param: str) -> ChatMessage:
    """An assistant turn: its text and its calls."""
    texts: list[str] = []
    calls: list[jobs.ToolCall] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            arguments = json.dumps(b.input, ensure_ascii=False)
            calls.append(jobs.ToolCall(id=b.id, name=b.name, arguments=arguments))
        elif isinstance(b, ToolResultBlock):
            raise RequestError("tool_result blocks belong in user turns", f"{param}[{j}]")
        elif not isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
            raise RequestError(
                f"{b.__struct_config__.tag} blocks are not supported (the served model reads"
                " text)", f"{param}[{j}]",
            )  # fmt: skip
    return ChatMessage("assistant", BLOCK_SEPARATOR.join(texts), tool_calls=tuple(calls))


def _messages(req: CountTokensRequest) -> tuple[ChatMessage, ...]:
    out = _system(req.system)
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(m.role, m.content))
        elif m.role == "user":
            out += _user(m.content, f"messages[{i}].content")
        else:
            out.append(_assistant(m.content, f"messages[{i}].content"))
    return tuple(out)


def _functions(req: CountTokensRequest) -> list[tt.FunctionDef]:
    functions = []
    for i, t in enumerate(req.tools or ()):  # a template writes them: bounded before it does
        why = too_large(t.input_schema)
        if why is not None:
            param = f"tools[{i}].input_schema"
            raise RequestError(f"{param} is too large a JSON schema: {why}", param)
        functions.append(tt.FunctionDef(name=t.name, description=t.description,
                                        parameters=t.input_schema))  # fmt: skip
    return functions


def parses_calls(req: CountTokensRequest) -> bool:
    """Whether the reply is read for tool calls: tools were offered and not turned off."""
    return bool(req.tools) and not isinstance(req.tool_choice, NoneChoice)


def _grammar(req: MessagesRequest, functions: list[tt.FunctionDef]) -> tuple[str | None, str]:
    """The grammar a forced `tool_choice` or `output_config.format` asks for (None: the model
    is free), and the field it came from."""
    choice = req.tool_choice
    fmt = req.output_config.format if req.output_config is not None else None
    if not isinstance(choice, (AnyChoice, NamedChoice)):
        if fmt is None:
            return None, "output_config"
        param = "output_config.format.schema"
        return structured.json_grammar(fmt.schema_, param), param
    if not functions:
        raise RequestError("tool_choice any or tool needs tools", "tool_choice")
    if fmt is not None:
        raise RequestError(
            "a forced tool_choice and output_config.format cannot both shape the reply",
            "tool_choice",
        )
    name = choice.name if isinstance(choice, NamedChoice) else None
    return tool_calls.call_grammar(functions, name, "tools[{i}].input_schema"), "tools"


def count_job(req: CountTokensRequest) -> Job:
    """The job whose prompt `count_tokens` counts."""
    functions = _functions(req)
    return Job(
        messages=_messages(req),
        tools=tuple(jobs.Tool(f.name, f.description, f.parameters) for f in functions),
        max_tokens=None,
    )


def messages_job(req: MessagesRequest) -> Job:
    """The job of a Messages request; RequestError for what it cannot be served as asked."""
    functions = _functions(req)
    grammar, grammar_param = _grammar(req, functions)
    temperature = 1.0 if req.temperature is None else req.temperature
    return Job(
        messages=_messages(req),
        tools=tuple(jobs.Tool(f.name, f.description, f.parameters) for f in functions),
        max_tokens=req.max_tokens,
        fit_max_tokens=True,
        temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
        top_p=max(1.0 if req.top_p is None else req.top_p, MIN_TOP_P),
        top_k=req.top_k or 0,
        stop=tuple(req.stop_sequences or ()),
        grammar=grammar,
        grammar_param=grammar_param,
    )
