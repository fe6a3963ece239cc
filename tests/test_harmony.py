"""gpt-oss's harmony replies (`stratad.server.harmony`): reasoning, answer and calls read apart,
whole and as they stream (cut anywhere, markers too), text off the format kept as content,
and the end-of-turn markers of a template that writes channels."""

from __future__ import annotations

import json

import msgspec
import pytest

from stratad.model.text.chat_template import end_of_turn_markers, render_chat, writes_channels
from stratad.runtime.template_form import template_message
from stratad.server.harmony import ChannelReader, Part, Reasoning, channel_message
from stratad.server.openai.requests import ChatCompletionRequest, chat_job
from stratad.server.tools import types as tt

THINK_ANSWER = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")  # fmt: skip
# a preamble on the commentary channel, then a call with its recipient after the channel
CALL_AFTER = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
              "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
              '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
              '<|message|>{"city":"Paris"}')  # fmt: skip
# the recipient before the channel, and the call's end marker kept in the text
CALL_BEFORE = ('<|start|>assistant to=functions.add<|channel|>commentary json<|message|>'
               '{"a": 2, "b": 3}<|call|>')  # fmt: skip


def _whole(text: str, tools: bool = True) -> list[tuple[str, object]]:
    reader = ChannelReader(tools)
    return _merged([*reader.feed(text), *reader.finish()])


def _merged(parts: list[Part]) -> list[tuple[str, object]]:
    """(kind, value) with neighbouring text of one kind joined; a call by name and arguments."""
    out: list[tuple[str, object]] = []
    for p in parts:
        if isinstance(p, tt.ToolCall):
            out.append(("call", (p.function.name, p.function.arguments)))
            continue
        kind, text = ("reasoning", p.text) if isinstance(p, Reasoning) else ("content", p)
        if out and out[-1][0] == kind:
            out[-1] = (kind, f"{out[-1][1]}{text}")
        elif text:
            out.append((kind, text))
    return out


def test_reasoning_and_answer() -> None:
    m = channel_message(THINK_ANSWER, tools=False)
    assert m.reasoning_content == "The user greets; answer briefly."
    assert m.content == "Hello! How can I help?" and m.tool_calls is None


@pytest.mark.parametrize("text", [CALL_AFTER, CALL_BEFORE])
def test_calls(text: str) -> None:
    m = channel_message(text, tools=True)
    assert m.tool_calls is not None and len(m.tool_calls) == 1
    call = m.tool_calls[0].function
    if text is CALL_AFTER:
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert m.content == "Checking." and m.reasoning_content == "Need the weather."
    else:
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
        assert m.content is None and m.reasoning_content is None


def test_without_tools_a_call_stays_content() -> None:
    m = channel_message(CALL_BEFORE, tools=False)
    assert m.tool_calls is None and m.content == '{"a": 2, "b": 3}'


def test_unreadable_arguments_stay_content() -> None:
    text = "<|channel|>commentary to=functions.add<|message|>{not json"
    m = channel_message(text, tools=True)
    assert m.tool_calls is None and m.content == "{not json"


def test_text_off_the_format_is_content() -> None:
    """A model that ignores the format: nothing is lost, nothing is reasoning."""
    m = channel_message("Just an answer, <|no marker|> here.", tools=True)
    assert m.content == "Just an answer, <|no marker|> here." and m.reasoning_content is None


@pytest.mark.parametrize("text", [THINK_ANSWER, CALL_AFTER, CALL_BEFORE])
def test_streamed_at_any_cut_reads_as_whole(text: str) -> None:
    """Fed in two pieces cut at every place, and a character at a time: the same parts, and no
    header or marker text shown."""
    want = _whole(text)
    for cut in range(len(text) + 1):
        reader = ChannelReader(tools=True)
        got = [*reader.feed(text[:cut]), *reader.feed(text[cut:]), *reader.finish()]
        assert _merged(got) == want, cut
    reader = ChannelReader(tools=True)
    parts = [p for c in text for p in reader.feed(c)] + reader.finish()
    assert _merged(parts) == want
    shown = "".join(p if isinstance(p, str) else p.text if isinstance(p, Reasoning) else ""
                    for p in parts)  # fmt: skip
    assert "<|" not in shown and "analysis" not in shown


def test_reasoning_streams_before_the_answer_ends() -> None:
    """Reasoning is passed on as it comes, not held to the end of its message."""
    reader = ChannelReader(tools=False)
    assert reader.feed("<|channel|>analysis<|message|>Thinking") == [Reasoning("Thinking")]
    assert reader.feed(" more<|e") == [Reasoning(" more")]  # the marker's start held
    assert reader.feed("nd|>") == []


HARMONY = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")  # fmt: skip


def test_end_markers_of_a_template_with_channels() -> None:
    """`<|end|>` closes the reasoning's message, not the turn: a harmony reply ends at
    `<|return|>` or `<|call|>` (declared by the model as its end tokens)."""
    assert writes_channels(HARMONY + "<|channel|>") and not writes_channels(HARMONY)
    assert "<|end|>" in end_of_turn_markers(HARMONY)
    assert "<|end|>" not in end_of_turn_markers(HARMONY + "<|channel|>final<|return|>")
    assert "<|return|>" in end_of_turn_markers(HARMONY + "<|channel|>final<|return|>")


def test_earlier_reasoning_reaches_the_template() -> None:
    """An assistant message's `reasoning_content` (as the answer gave it) is written back by a
    template that reads it, under gpt-oss's name `thinking`."""
    body = {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]}  # fmt: skip
    req = msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)
    job = chat_job(req, None)
    assert job.messages is not None
    template = ("{% for m in messages %}<|start|>{{ m['role'] }}"
                "{% if m.get('thinking') %}<|channel|>analysis<|message|>{{ m['thinking'] }}"
                "<|end|><|start|>assistant{% endif %}<|message|>{{ m['content'] }}<|end|>"
                "{% endfor %}")  # fmt: skip
    text = render_chat(template, [template_message(m) for m in job.messages])
    assert "<|channel|>analysis<|message|>Greet back.<|end|>" in text
    assert text.count("analysis") == 1
