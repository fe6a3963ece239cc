"""Tool calls in a reply: reading the Hermes/Qwen `<tool_call>{json}</tool_call>` form, whole or
as it streams, and the grammar that forces one call (`tool_choice` required or named).

A call is `<tool_call>`, a JSON object with `name` and `arguments` (an object), `</tool_call>`;
a model may also stop right after the JSON, without the closing tag. A block whose JSON does
not read as a call stays in the content, tags and all, so that nothing the model wrote is lost.
The forced grammar is that form with the JSON constrained, through llguidance, to the named
function's (or any offered function's) `parameters` schema; the reply ends after the call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import llguidance

from stratad.server.markers import held_back
from stratad.server.openai import responses as rs
from stratad.server.openai.requests import ChatCompletionRequest, RequestError
from stratad.server.tools import types as tt

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the Hermes form's own separators, so that a forced call reads like the model's free ones
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parses_calls(req: ChatCompletionRequest) -> bool:
    """Whether the reply is read for tool calls: tools were offered and not turned off."""
    return bool(req.tools) and req.tool_choice != "none"


def _call(body: str) -> tt.ToolCall | None:
    """The call a block's JSON makes; None if it is not one."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return tt.ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        type="function",
        function=tt.FunctionCall(
            name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False)
        ),
    )


class CallReader:
    """A reply's text, fed as it comes, split into content and calls.

    `feed` and `finish` return what is known so far, in order: text (str) and calls. Text that
    may begin a call is held until it is known; once a call has been made, text that is only
    whitespace is held until more follows (and dropped at the end).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._pending = ""  # whitespace after a call
        self.calls = 0

    def feed(self, text: str) -> list[str | tt.ToolCall]:
        self._buf += text
        out: list[str | tt.ToolCall] = []
        while True:
            if self._inside:
                end, again = self._buf.find(CLOSE), self._buf.find(OPEN)
                if again >= 0 and (end < 0 or again < end):  # a new call: this one was unclosed
                    self._close(self._buf[:again], out, closed=False)
                    self._buf = self._buf[again:]
                    continue
                if end < 0:
                    return out
                self._close(self._buf[:end], out)
                self._buf = self._buf[end + len(CLOSE) :]
                continue
            start = self._buf.find(OPEN)
            if start < 0:
                keep = held_back(self._buf, (OPEN,))
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            self._text(self._buf[:start], out)
            self._buf, self._inside = self._buf[start + len(OPEN) :], True

    def finish(self) -> list[str | tt.ToolCall]:
        """The rest: an unclosed last call, or held text."""
        out: list[str | tt.ToolCall] = []
        if self._inside:
            self._close(self._buf, out, closed=False)
        else:
            self._text(self._buf, out)
        self._buf, self._inside = "", False
        return out

    def _text(self, text: str, out: list[str | tt.ToolCall]) -> None:
        if self.calls and not (self._pending + text).strip():
            self._pending += text
            return
        text, self._pending = self._pending + text, ""
        if text:
            out.append(text)

    def _close(self, body: str, out: list[str | tt.ToolCall], closed: bool = True) -> None:
        self._inside = False
        call = _call(body)
        if call is None:
            self._text(OPEN + body + (CLOSE if closed else ""), out)
            return
        self._pending = ""
        self.calls += 1
        out.append(call)


def read_reply(text: str) -> tuple[str | None, list[tt.ToolCall]]:
    """A whole reply's content (None when it is only calls) and calls; without calls the
    content is the text as it is."""
    reader = CallReader()
    parts = reader.feed(text) + reader.finish()
    calls = [p for p in parts if isinstance(p, tt.ToolCall)]
    if not calls:
        return text, []
    content = "".join(p for p in parts if isinstance(p, str)).strip()
    return content or None, calls


def reply_message(text: str, tools: bool) -> rs.AssistantMessage:
    """A chat reply's message: its content, and its calls when `tools` asks them read."""
    if not tools:
        return rs.AssistantMessage(role="assistant", content=text)
    content, calls = read_reply(text)
    return rs.AssistantMessage(role="assistant", content=content, tool_calls=calls or None)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that ended by itself after making calls finished with them."""
    return "tool_calls" if called and reason == "stop" else reason


# --- the forced call --------------------------------------------------------------------------


def _call_schema(f: tt.FunctionDef) -> dict[str, Any]:
    """The JSON of one call of `f`; the parameters' `$defs` are lifted to the top, where their
    `#/$defs/...` references point."""
    parameters = dict(f.parameters if f.parameters is not None else NO_PARAMETERS)
    defs: dict[str, Any] = {k: parameters.pop(k) for k in ("$defs", "definitions")
                            if k in parameters}  # fmt: skip
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,
        "x-guidance": _JSON_OPTIONS,
    }


def _grammar(functions: list[tt.FunctionDef]) -> tuple[str, list[str]]:
    """llguidance's grammar of one call of any of `functions`, and why it fails (or [])."""
    rules = [f"c{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    lark = "\n".join([
        f'start: "{OPEN}\\n" call "\\n{CLOSE}"',
        "call: " + " | ".join(f"c{i}" for i in range(len(functions))),
        *rules,
    ])  # fmt: skip
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        return "", [str(e)]
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return grammar, messages if failed else []


def forced_grammar(req: ChatCompletionRequest) -> str | None:
    """The grammar `tool_choice` asks for (None: the model is free); RequestError for a choice
    that names no offered function, or a schema llguidance cannot compile."""
    choice, tools = req.tool_choice, req.tools or []
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise RequestError("tool_choice other than auto or none needs tools", "tool_choice")
    name = choice.function.name if isinstance(choice, tt.NamedToolChoice) else None
    return call_grammar([t.function for t in tools], name, "tools[{i}].function.parameters")


def call_grammar(functions: list[tt.FunctionDef], name: str | None, schema_param: str) -> str:
    """The grammar of one call of the function `name` (None: of any of `functions`).

    RequestError for a name not among them, or a schema llguidance cannot compile, naming
    `schema_param` (the schema's field, `{i}` the function's index) for that one.
    """
    indices = list(range(len(functions)))
    if name is not None:
        indices = [i for i in indices if functions[i].name == name]
        if not indices:
            raise RequestError(
                f"tool_choice names the function {name[:64]!r}, which is not among tools",
                "tool_choice",
            )
    grammar, why = _grammar([functions[i] for i in indices])
    if not why:
        return grammar
    for i in indices:  # name the function whose schema fails
        if _grammar([functions[i]])[1]:
            param = schema_param.format(i=i)
            raise RequestError(f"{param} is not a usable JSON schema: {'; '.join(why)}", param)
    raise RequestError(f"the tools cannot be forced: {'; '.join(why)}", "tools")
