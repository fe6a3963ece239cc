"""Text <-> token ids for a served model, from GGUF metadata or a Hugging Face `tokenizer.json`.

Encoding runs on a `tokenizers.Tokenizer` set up to give llama.cpp's ids for the same GGUF: the
pre-tokenizer regexes are picked by `tokenizer.ggml.pre` (llama.cpp's `llama-vocab.cpp` table),
control tokens in the text are parsed as specials (llama.cpp's `parse_special=True`), except in
a conversation's message content (`encode_chat`): a `<|im_end|>` a user types is text, or the
user could end their turn and write a system turn of their own.
Decoding skips the HF decoder: every id maps to the exact bytes it stands for (`token_bytes`),
so `Tokenizer.decode` and the incremental `StreamDecoder` agree byte for byte. The builders
(`tokenizer_from_gguf`, `tokenizer_from_hf`) are in `stratad.model.text.tokenizer_build`.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from stratad.model.text import tool_prompt
from stratad.model.text.chat_template import CHATML_TEMPLATE, render_chat
from stratad.model.text.fim import FimTokens

# Around each message's content while the template renders, to tell its text from the
# template's markup (private-use code points: removed from the content first).
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
_MARKS = re.compile(f"([{_OPEN}{_CLOSE}])")


class Tokenizer:
    """Encode, decode and chat-format for one model. Build it with `tokenizer_from_gguf/_hf`."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        pieces: Sequence[bytes],
        special_ids: Iterable[int],
        bos_id: int | None,
        eos_id: int | None,
        end_ids: Iterable[int] = (),
        add_bos: bool,
        strip_leading_space: bool = False,
        chat_template: str | None = None,
        fim: FimTokens | None = None,
    ) -> None:
        if add_bos and bos_id is None:
            raise ValueError("the tokenizer adds a BOS token but declares none")
        self.hf = hf  # encoding only: no post-processor, BOS is added here
        self._pieces = list(pieces)  # id -> the bytes it decodes to
        self.special_ids = frozenset(special_ids)  # control tokens: dropped by skip_special
        self.bos_id = bos_id
        self.eos_id = eos_id
        # every id that ends a reply: EOS and end-of-turn markers such as <|eot_id|>
        self.eos_ids = frozenset(i for i in (eos_id, *end_ids) if i is not None)
        self.add_bos = add_bos
        # sentencepiece's "add dummy prefix": encode writes a space before the text, decode drops it
        self.strip_leading_space = strip_leading_space
        self.chat_template = chat_template
        self.fim = fim or FimTokens()  # fill-in-the-middle tokens (`stratad.model.text.fim`)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most text bytes one token stands for: n tokens never hold more than n times it.
        Kept: every request is checked against it, and a scan of the vocabulary holds the GIL
        for milliseconds (2 ms on 49k tokens), stalling the engine thread's steps."""
        return max((len(p) for p in self._pieces), default=1) or 1

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def bos_token(self) -> str:
        return "" if self.bos_id is None else self.token_text(self.bos_id)

    @property
    def eos_token(self) -> str:
        return "" if self.eos_id is None else self.token_text(self.eos_id)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) become their ids.

        `add_special` adds BOS, and only if the model asks for it.
        """
        # encode_batch lets go of the GIL while it works (encode holds it: seconds on megabytes)
        ids: list[int] = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special and self.add_bos:
            assert self.bos_id is not None
            return [self.bos_id, *ids]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with no BOS, control tokens written in it read as text (code to
        infill may spell `<|endoftext|>`)."""
        ids: list[int] = self._text_only.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text a conversation becomes by the template (what `encode_chat` encodes,
        llama-server's /apply-template), `tools` written as `encode_chat` writes them."""
        template = self.chat_template or CHATML_TEMPLATE
        messages, given = tool_prompt.for_template(template, messages, tools)
        extra = {"tools": given} if given else {}
        return self.apply_chat_template(messages, add_generation_prompt, **extra)

    @functools.cached_property
    def _control_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.hf.get_added_tokens_decoder().values())

    @functools.cached_property
    def _text_only(self) -> tokenizers.Tokenizer:
        """The same tokenizer, reading control tokens written in the text as text."""
        plain = tokenizers.Tokenizer.from_str(self.hf.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation by its template: the template's markup with its control
        tokens, each message's content as text, whatever it contains. `tools` (OpenAI's form)
        go to a template that writes them, else into the system prompt (`tool_prompt`).

        A conversation whose content names no control token is the rendered text encoded as
        it is; one that does is rendered with its content marked, and each piece encoded by
        what it is (the text around a piece of content may then split differently). The same
        holds for every string of the tools and of the history's tool calls (names,
        descriptions, arguments, schema keys) that a template writes itself: user-controlled
        text stays text wherever the template puts it.
        """
        template = self.chat_template or CHATML_TEMPLATE
        messages, given = tool_prompt.for_template(template, messages, tools)
        contents = [m.get("content") for m in messages]
        calls = [m.get("tool_calls") for m in messages]
        if not any(isinstance(c, str) and self._names_control(c) for c in contents) and not (
            self._names_control_in(calls) or self._names_control_in(given)
        ):
            extra = {"tools": given} if given else {}
            text = self.apply_chat_template(messages, add_generation_prompt, **extra)
            return self.encode(text, False)
        marked = [
            {**m, "content": _OPEN + _MARKS.sub("", c) + _CLOSE} if isinstance(c, str) else m
            for m, c in zip(messages, contents, strict=True)
        ]
        marked = [{**m, "tool_calls": self._mark(m["tool_calls"])} if m.get("tool_calls") else m
                  for m in marked]  # fmt: skip
        extra = {"tools": self._mark(given)} if given else {}
        ids: list[int] = []
        depth = 0
        rendered = self.apply_chat_template(marked, add_generation_prompt, **extra)
        for piece in _MARKS.split(rendered):
            if piece in (_OPEN, _CLOSE):
                depth = max(depth + (1 if piece == _OPEN else -1), 0)
            elif piece:
                hf = self._text_only if depth else self.hf
                ids += hf.encode_batch([piece], add_special_tokens=False)[0].ids
        return ids

    def _names_control_in(self, value: Any) -> bool:
        """Whether any string in `value` (nested lists and dicts, keys too) names a control
        token."""
        todo = [value]
        while todo:
            v = todo.pop()
            if isinstance(v, str):
                if self._names_control(v):
                    return True
            elif isinstance(v, dict):
                todo.extend(v.keys())
                todo.extend(v.values())
            elif isinstance(v, list):
                todo.extend(v)
        return False

    def _mark(self, value: Any) -> Any:
        """`value` with every string that names a control token marked as content."""
        if isinstance(value, str):
            named = self._names_control(value)
            return _OPEN + _MARKS.sub("", value) + _CLOSE if named else value
        if isinstance(value, dict):
            return {self._mark(k): self._mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark(v) for v in value]
        return value

    def _names_control(self, text: str) -> bool:
        return any(t in text for t in self._control_texts)

    def token_bytes(self, token_id: int) -> bytes:
        """What one token stands for; b"" for an id past the vocabulary (padded embeddings)."""
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else b""

    def token_text(self, token_id: int) -> str:
        """One token's text (a lone piece of a UTF-8 sequence shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        data = b"".join(
            self.token_bytes(i) for i in ids if not (skip_special and i in self.special_ids)
        )
        text = data.decode("utf-8", errors="replace")
        return text[1:] if self.strip_leading_space and text.startswith(" ") else text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt for a conversation, by the model's template or else ChatML."""
        return render_chat(
            self.chat_template or CHATML_TEMPLATE,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def save(self, directory: Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json`, readable by `tokenizer_from_hf`."""
        directory.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {"add_bos_token": self.add_bos}
        if self.bos_id is not None:
            config["bos_token"] = self.bos_token
        if self.eos_id is not None:
            config["eos_token"] = self.eos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"eos_token_id": sorted(self.eos_ids)}
        (directory / "generation_config.json").write_text(json.dumps(generation) + "\n")


class StreamDecoder:
    """Text of ids fed one at a time; an incomplete UTF-8 sequence is held until it completes.

    The pieces returned by `feed` and `flush` join to exactly `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer.strip_leading_space  # until the first character is out

    def feed(self, token_id: int) -> str:
        if self._skip_special and token_id in self._tokenizer.special_ids:
            return ""
        return self._emit(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def flush(self) -> str:
        """The held-back bytes of an unfinished sequence (as U+FFFD); the decoder is reset."""
        text = self._emit(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        return text

    def _emit(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            return text[1:] if text.startswith(" ") else text
        return text


# --- GGUF ---------------------------------------------------------------------------------
