"""Tools in the prompt: what a chat template is given, and the Hermes/Qwen form for templates
that do not write tools themselves.

Messages and tools come in OpenAI's form (assistant `tool_calls` with `arguments` as JSON
text, `tool` messages with `tool_call_id`, tools as `{"type": "function", "function": ...}`).
A template that reads `tools` (Qwen's, Hermes', Llama 3.1's, ...) gets them as Hugging Face's
`apply_chat_template` hands them over: the arguments as objects, for the template's `tojson`.
A template that ignores them (SmolLM2's, the ChatML fallback) would drop the functions, the
calls and their results in silence; for those the conversation is rewritten in the form Qwen
2.5 and Hermes models are trained on: the signatures in a `<tools>` block of the system
prompt, each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the
assistant's turn, the results as `<tool_response>` blocks in a user turn.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from stratad.model.text.chat_template import render_chat

TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{signatures}\n</tools>\n\nFor each function call, return a json object with function name"
    " and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

_PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "strata_probe",
            "description": "Probe.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@lru_cache(maxsize=16)
def reads_tools(template: str) -> bool:
    """Whether `template` writes the `tools` it is given (it renders differently with them)."""
    try:
        plain = render_chat(template, _PROBE_MESSAGES)
        return render_chat(template, _PROBE_MESSAGES, tools=_PROBE_TOOLS) != plain
    except ValueError:  # a template that refuses the probe: judge by its text
        return "tools" in template


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def for_template(
    template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render `template` with (tools None: they are in the messages)."""
    if not uses_tools(messages, tools):
        return messages, None
    if reads_tools(template):
        return [_arguments_as_objects(m) for m in messages], tools or None
    return hermes_messages(messages, tools), None


# Arguments nested deeper than this stay text: no tool takes them, and parsing, encoding or
# rendering them recurses once per level (`"[" * 2000 + "]" * 2000` raised RecursionError)
MAX_DEPTH = 64
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _depth(text: str) -> int:
    """How deep the brackets of JSON text nest (outside its strings)."""
    depth = deepest = 0
    for c in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _arguments(text: str) -> Any:
    if _depth(text) > MAX_DEPTH:
        return text  # written as it came
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # written as it came


def _arguments_as_objects(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def tool_call_text(name: str, arguments: str) -> str:
    """One call as a Hermes/Qwen model writes it."""
    body = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with the tools, calls and results written into plain messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):  # consecutive results share one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "_results": True})
        elif m.get("tool_calls"):
            calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]  # fmt: skip
            text = "\n".join([m["content"], *calls] if m["content"] else calls)
            out.append({"role": m["role"], "content": text})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if tools:
        signatures = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        block = TOOLS_BLOCK.format(signatures=signatures)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
