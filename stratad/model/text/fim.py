"""A model's fill-in-the-middle tokens, found as llama.cpp finds them.

A GGUF may name them (`tokenizer.ggml.fim_pre_token_id`, ..., or the older
`tokenizer.ggml.prefix_token_id` / `suffix_token_id` / `middle_token_id`); otherwise they are
the control tokens spelled as a family of code models spells them (llama.cpp's table in
`llama-vocab.cpp`: Qwen's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`, CodeLlama's `<PRE>`,
...). `/infill` builds its prompt from them (`stratad.server.llama.infill`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# the spellings llama.cpp recognises, by role
NAMES: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}  # fmt: skip
# the GGUF keys that name them (the older key of each role second)
GGUF_KEYS: dict[str, tuple[str, ...]] = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}


@dataclass(frozen=True)
class FimTokens:
    """The ids of the FIM roles (None: the model has no such token)."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    rep: int | None = None
    """the repository name's marker (the repo-level pattern)"""
    sep: int | None = None
    """the file separator (the repo-level pattern)"""

    @property
    def usable(self) -> bool:
        """Whether infilling works: prefix, suffix and middle are all known."""
        return None not in (self.pre, self.suf, self.mid)


def find_fim(specials: Mapping[str, int], declared: Mapping[str, int | None]) -> FimTokens:
    """The FIM tokens of a vocabulary: `declared` ids by role (from the model's metadata) first,
    else the control token (`specials`: text -> id) spelled as llama.cpp expects."""
    found: dict[str, int | None] = {}
    for role, names in NAMES.items():
        given = declared.get(role)
        found[role] = given if given is not None else next(
            (specials[n] for n in names if n in specials), None
        )
    return FimTokens(**found)


def gguf_declared(meta: Mapping[str, object]) -> dict[str, int | None]:
    """The FIM ids a GGUF's metadata names, by role."""
    out: dict[str, int | None] = {}
    for role, keys in GGUF_KEYS.items():
        value = next((meta[k] for k in keys if isinstance(meta.get(k), int)), None)
        out[role] = value if isinstance(value, int) and value >= 0 else None
    return out
