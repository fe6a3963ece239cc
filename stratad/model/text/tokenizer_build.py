"""Building a `Tokenizer` from the model: GGUF metadata (`gpt2` byte-level BPE with the
pre-tokenizer regex that `tokenizer.ggml.pre` names in llama.cpp's table, or `llama`
SentencePiece) or a Hugging Face tokenizer.json with its config files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from stratad.model.spec import Model
from stratad.model.text.chat_template import end_of_turn_markers
from stratad.model.text.fim import find_fim, gguf_declared
from stratad.model.text.tokenizer import Tokenizer

# GGUF token types (llama.cpp's `llama_token_type`)
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 2, 3, 4, 5, 6


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's take on the cased-word regex of o200k: "upper" is a letter other than a-z,
# "lower" one other than A-Z, and combining marks are not letters (HF's regex differs there)
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class _PreTokenizer:
    splits: tuple[str, ...]  # applied in turn, each splitting the pieces of the previous one
    ignore_merges: bool = False  # a word that is a whole token is taken as is
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token


# `tokenizer.ggml.pre` -> splitting, as llama.cpp's llm_tokenizer_bpe (same names, same regexes)
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), _PreTokenizer((_GPT2,))),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _PreTokenizer((r"\p{N}", _GPT2)),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
        _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _PreTokenizer((_QWEN2,))),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _PreTokenizer((_GPT4O,))),
    "deepseek-v3": _PreTokenizer(_DEEPSEEK3),
}


@cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_level_bytes(text: str) -> bytes:
    alphabet = _byte_alphabet()
    if all(c in alphabet for c in text):
        return bytes(alphabet[c] for c in text)
    return text.encode()  # a raw-text token mislabelled normal


def _sentencepiece_bytes(text: str, byte_fallback: bool) -> bytes:
    if byte_fallback and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("\u2581", " ").encode()


def _end_ids(
    declared: Iterable[int | None], specials: Mapping[str, int], template: str | None
) -> list[int]:
    """The declared end ids, and the end-of-turn marker the chat template writes."""
    marked = [specials[m] for m in end_of_turn_markers(template) if m in specials]
    return [i for i in declared if i is not None] + marked


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Sentencepiece merges best score first: llama.cpp merges the pair whose union scores best."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for merged, i in vocab.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def tokenizer_from_gguf(meta: Mapping[str, Any], chat_template: str | None = None) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (`tokenizer.ggml.model` gpt2 or llama);
    `chat_template` replaces the GGUF's own (`model.chat_template`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"unsupported tokenizer model {kind!r} (tokenizer.ggml.model); "
            "supported: 'gpt2' (byte-level BPE), 'llama' (sentencepiece)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    hf, default_add_bos, strip = (
        _byte_level_bpe(meta, vocab) if kind == "gpt2" else _sentencepiece(meta, tokens, vocab)
    )

    specials = [i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)]
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    hf.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED
        ]
    )

    pieces = []
    for text, t in zip(tokens, types, strict=True):
        if t in (_CONTROL, _UNKNOWN, _USER_DEFINED):
            pieces.append(text.encode())
        elif t == _UNUSED:
            pieces.append(b"")
        elif kind == "gpt2":
            pieces.append(_byte_level_bytes(text))
        else:
            pieces.append(_sentencepiece_bytes(text, byte_fallback=t == _BYTE))

    template = chat_template or meta.get("tokenizer.chat_template")
    declared = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer(
        hf,
        pieces=pieces,
        special_ids=specials,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        end_ids=_end_ids(declared, {tokens[i]: i for i in specials}, template),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        strip_leading_space=strip,
        chat_template=template,
        fim=find_fim(vocab, gguf_declared(meta)),
    )


def _byte_level_bpe(
    meta: Mapping[str, Any], vocab: dict[str, int]
) -> tuple[tokenizers.Tokenizer, bool, bool]:
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ValueError(
            f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    # a merge is "left right"; the first space after index 0 separates them, as in llama.cpp
    merges = [
        (m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in meta["tokenizer.ggml.merges"]
    ]
    hf = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    return hf, pre.add_bos, False


def _sentencepiece(
    meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int]
) -> tuple[tokenizers.Tokenizer, bool, bool]:
    if "tokenizer.ggml.scores" not in meta:
        raise ValueError("sentencepiece tokenizer without tokenizer.ggml.scores")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab,
        _spm_merges(tokens, meta["tokenizer.ggml.scores"]),
        unk_token=None if unk is None else tokens[unk],
        fuse_unk=True,
        byte_fallback=True,
    )
    hf = tokenizers.Tokenizer(model)
    # llama.cpp escapes spaces and, with add_space_prefix, writes one before every stretch of
    # text (at the start and after each special token), like HF's per-section normalizer.
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    escape = [normalizers.Replace(" ", "\u2581")]
    hf.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), *escape] if space_prefix else escape
    )
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return hf, True, space_prefix


# --- Hugging Face ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_name(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _decoder_steps(spec: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [s for d in spec.get("decoders", []) for s in _decoder_steps(d)]
    return [spec]


def _metaspace_prepends(step: Mapping[str, Any]) -> bool:
    # newer files say prepend_scheme (always / first / never), older ones add_prefix_space
    return (
        step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
        != "never"
    )


def tokenizer_from_hf(model_dir: Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a HF model folder: tokenizer.json, tokenizer_config.json (bos, eos,
    add_bos_token, chat_template), chat_template.jinja and generation_config.json (eos ids);
    `chat_template` replaces the folder's own (`model.chat_template`)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (only fast tokenizers are supported)")
    spec = _read_json(path)
    config = _read_json(model_dir / "tokenizer_config.json")
    hf = tokenizers.Tokenizer.from_file(str(path))

    steps = _decoder_steps(spec.get("decoder"))
    kinds = {s.get("type") for s in steps}
    if "ByteLevel" in kinds:
        sentencepiece = False
    elif kinds & {"Metaspace", "ByteFallback"} or any(
        s.get("type") == "Replace" and s.get("content") == " " for s in steps
    ):
        sentencepiece = True
    else:
        raise ValueError(f"{path}: unsupported decoder {sorted(map(str, kinds))}")
    strip = sentencepiece and any(
        (s.get("type") == "Strip" and s.get("start", 0) >= 1)
        or (s.get("type") == "Metaspace" and _metaspace_prepends(s))
        for s in steps
    )

    added = hf.get_added_tokens_decoder()
    byte_fallback = bool(spec.get("model", {}).get("byte_fallback", False))
    pieces = []
    for i in range(max(hf.get_vocab(with_added_tokens=True).values()) + 1):
        text = hf.id_to_token(i)
        if text is None:
            pieces.append(b"")
        elif i in added:
            pieces.append(added[i].content.encode())
        elif sentencepiece:
            pieces.append(_sentencepiece_bytes(text, byte_fallback))
        else:
            pieces.append(_byte_level_bytes(text))
    specials = {i: t.content for i, t in added.items() if t.special}

    def token_id(key: str) -> int | None:
        name = _token_name(config.get(key))
        return None if name is None else hf.token_to_id(name)

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # not stated: whatever the post-processor does
        add_bos = bos_id is not None and hf.encode("a").ids[:1] == [bos_id]

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = chat_template or template

    generation_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    declared = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    return Tokenizer(
        hf,
        pieces=pieces,
        special_ids=specials,
        bos_id=bos_id,
        eos_id=eos_id,
        end_ids=_end_ids(declared, {t: i for i, t in specials.items()}, template),
        add_bos=add_bos,
        strip_leading_space=strip,
        chat_template=template,
        fim=find_fim(hf.get_vocab(with_added_tokens=True), {}),
    )


def load_tokenizer(model: Model, chat_template: str | None = None) -> Tokenizer:
    """The model's tokenizer; `chat_template` (model.chat_template's text) replaces its own."""
    if model.source.is_dir():
        return tokenizer_from_hf(model.source, chat_template)
    return tokenizer_from_gguf(model.metadata, chat_template)
