"""Rendering a model's chat template (the Jinja2 dialect of Hugging Face `chat_template`s).

Templates come from model files, so they run in an immutable sandbox, with the helpers HF
templates expect (`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape).
Every failure, at compile or render time, surfaces as a `ValueError` saying what went wrong.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The fallback for a model that ships no template: ChatML, as written by Qwen, SmolLM and
# others. Message content may be a string or a list of OpenAI content parts (text parts kept).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# End-of-turn markers that llama.cpp also recognizes by name. The one a template writes ends a
# reply as surely as EOS does.
END_OF_TURN_MARKERS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>",
)  # fmt: skip


def writes_channels(template: str | None) -> bool:
    """Whether `template` asks for replies in OpenAI's harmony channels (gpt-oss's)."""
    return template is not None and "<|channel|>" in template and "<|message|>" in template


def end_of_turn_markers(template: str | None) -> list[str]:
    """The known end-of-turn markers `template` writes (ChatML's when there is no template).
    In harmony's format `<|end|>` closes a message, not the turn (the reasoning's message
    comes before the answer's): `<|return|>` and `<|call|>` end it."""
    markers = [m for m in END_OF_TURN_MARKERS if m in (template or CHATML_TEMPLATE)]
    return [m for m in markers if m != "<|end|>"] if writes_channels(template) else markers


class _TemplateRaised(Exception):
    """What `raise_exception(...)` inside a template throws."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's filter: plain json.dumps (jinja's own `tojson` HTML-escapes <, >, & and ').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from e


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The prompt for `messages`; `extra` (tools, enable_thinking, ...) goes to the template."""
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except _TemplateRaised as e:
        raise ValueError(f"chat template rejected the conversation: {e}") from e
    except jinja2.TemplateError as e:  # undefined variables, sandbox violations, ...
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
