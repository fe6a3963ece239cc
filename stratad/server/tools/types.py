"""OpenAI's tool schemas (msgspec): the functions offered, `tool_choice`, and the calls an
assistant message carries, in requests (a conversation's history) and in replies alike.

`stratad.server.openai.requests` puts them into its request and response types; what is done
with them is `stratad.server.tools.calls`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

MAX_TOOLS = 128  # OpenAI's limit

FunctionName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern="^[a-zA-Z0-9_-]+$")
]


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class FunctionDef(_Struct, frozen=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """a JSON schema of the arguments object; none: the function takes no arguments"""
    strict: bool | None = None
    """a forced call follows the schema either way"""


class ToolDef(_Struct, frozen=True):
    type: Literal["function"]
    function: FunctionDef


Tools = Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)]


class ChosenFunction(_Struct, frozen=True):
    name: str


class NamedToolChoice(_Struct, frozen=True):
    """Call this function (the output is constrained to one call of it)."""

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None
"""none: the tools are in the prompt, the reply is a message; auto (the default): the model
decides, a call it writes is returned as one; required: exactly one call of some tool."""


class FunctionCall(_Struct, frozen=True):
    name: str
    arguments: str
    """a JSON object, as text"""


class ToolCall(_Struct, frozen=True):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolCallDelta(_Struct, frozen=True):
    """A streamed call: sent whole, once its text is complete."""

    index: int
    id: str
    type: Literal["function"]
    function: FunctionCall
