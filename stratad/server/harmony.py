"""Replies in OpenAI's harmony format (gpt-oss): messages in channels, read apart.

A chat template that writes `<|channel|>` (gpt-oss's) asks the model for messages of the form

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the prompt ends with `<|start|>assistant`, so the first header starts at `<|channel|>`). A
header names the channel and, for a tool call, its recipient (`to=functions.NAME`, before or
after the channel) and the arguments' type (`<|constrain|>json`); the body runs to `<|end|>`,
`<|call|>` or `<|return|>` (the last two end the turn: they are end tokens, so a reply usually
stops before its text). The analysis channel is reasoning (`reasoning_content`, as
llama-server and DeepSeek's API name it); the final channel, and commentary without a recipient
(a preamble the user may see), is content; a message to `functions.NAME` is a call of NAME,
its body the arguments, when the request offered tools. Text before any header (a model that
ignores the format) is content; a body whose call does not read is kept as content, so nothing
the model wrote is lost. Headers are never shown.

`ChannelReader` reads a reply as it streams (a marker cut between two deltas is held until it
is known), `channel_message` a whole one; both give the same parts.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from stratad.server.markers import held_back
from stratad.server.openai import responses as rs
from stratad.server.tools import types as tt

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a body's end
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Reasoning:
    """Text of the analysis channel."""

    text: str


Part = str | Reasoning | tt.ToolCall


@dataclass(frozen=True)
class _Header:
    channel: str
    recipient: str | None  # e.g. "functions.get_weather"

    @classmethod
    def read(cls, text: str) -> _Header:
        """A header's text: role, `<|channel|>NAME`, ` to=RECIPIENT`, `<|constrain|>TYPE`."""
        recipient = _RECIPIENT.search(text)
        channel = ""
        if CHANNEL in text:
            words = text.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
            channel = words[0] if words else ""
        return cls(channel, recipient.group(1) if recipient else None)


class ChannelReader:
    """A harmony reply, fed as it comes, split into content, reasoning and calls.

    `feed` and `finish` return what is known so far, in order. `tools`: a message to a
    recipient is read as a call (else its body is content)."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.calls = 0
        self._buf = ""
        self._header: _Header | None = _Header("final", None)  # text before any header
        self._in_header = False
        self._body = ""  # a call's body, held whole until it ends

    def feed(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Part]:
        """The rest, once the reply has ended (a body still open ends here)."""
        out: list[Part] = []
        if not self._in_header and self._buf:
            self._emit(self._buf, out)
        self._buf = ""
        self._end_body(out)
        return out

    def _step(self, out: list[Part]) -> bool:
        """Read up to the next marker; False when more text is needed."""
        if self._in_header:
            at = self._buf.find(MESSAGE)
            if at < 0:
                return False
            self._header = _Header.read(self._buf[:at])
            self._buf, self._in_header = self._buf[at + len(MESSAGE) :], False
            return True
        ends = [(i, m) for m in (START, CHANNEL, *ENDS) if (i := self._buf.find(m)) >= 0]
        if not ends:
            keep = held_back(self._buf, MARKERS)
            self._emit(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        at, marker = min(ends)
        self._emit(self._buf[:at], out)
        self._end_body(out)
        if marker in (START, CHANNEL):  # a header follows (its channel marker read with it)
            self._in_header = True
            self._buf = self._buf[at + (len(START) if marker == START else 0) :]
        else:
            self._buf = self._buf[at + len(marker) :]
            self._header = None  # between messages: only a new header is read
        return True

    def _call_body(self) -> bool:
        h = self._header
        return self.tools and h is not None and h.recipient is not None

    def _emit(self, text: str, out: list[Part]) -> None:
        h = self._header
        if not text or h is None:
            if text.strip():  # text outside any message (a model off the format): content
                out.append(text)
            return
        if self._call_body():
            self._body += text
        elif h.channel == "analysis":
            out.append(Reasoning(text))
        else:
            out.append(text)

    def _end_body(self, out: list[Part]) -> None:
        if self._call_body():
            h = self._header
            assert h is not None and h.recipient is not None
            call = _call(h.recipient, self._body)
            if call is not None:
                out.append(call)
                self.calls += 1
            elif self._body:
                out.append(self._body)
        self._body = ""
        self._header = None


def _call(recipient: str, body: str) -> tt.ToolCall | None:
    """The call a message to `recipient` makes with the arguments `body`; None if they are not
    a JSON object."""
    try:
        arguments = json.loads(body) if body.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    name = recipient.removeprefix("functions.")
    return tt.ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        type="function",
        function=tt.FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)),
    )


def channel_message(text: str, tools: bool) -> rs.AssistantMessage:
    """A whole harmony reply as the chat answer's message."""
    reader = ChannelReader(tools)
    parts = reader.feed(text) + reader.finish()
    content = "".join(p for p in parts if isinstance(p, str))
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    calls = [p for p in parts if isinstance(p, tt.ToolCall)]
    return rs.AssistantMessage(
        role="assistant",
        content=content if content or not calls else None,
        tool_calls=calls or None,
        reasoning_content=reasoning or None,
    )
