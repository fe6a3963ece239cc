"""A job's messages and tools in the form chat templates read (OpenAI's)."""

from __future__ import annotations

from typing import Any

from stratad.runtime.jobs import ChatMessage, Job


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (OpenAI's form)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning:  # under the names templates read it by (gpt-oss's: `thinking`)
        out["reasoning_content"] = out["thinking"] = m.reasoning
    return out


def template_tools(job: Job) -> list[dict[str, Any]] | None:
    """The job's tools as chat templates read them (OpenAI's form); None: no tools."""
    if not job.tools:
        return None
    no_parameters = {"type": "object", "properties": {}}
    return [
        {"type": "function", "function": {
            "name": t.name,
            **({"description": t.description} if t.description is not None else {}),
            "parameters": t.parameters if t.parameters is not None else no_parameters,
        }}
        for t in job.tools
    ]  # fmt: skip
