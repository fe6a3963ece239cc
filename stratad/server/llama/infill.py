"""The fill-in-the-middle prompt of llama-server's `/infill`, built from the model's FIM tokens
(`stratad.model.text.fim`) as llama-server's `format_prompt_infill` builds it:

    [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ...  [FIM_SEP]filename\\n
    [BOS][FIM_PRE]{input_prefix}{prompt}[FIM_SUF]{input_suffix}[FIM_MID]

The repository lines need the model's repo and file-separator tokens; without them each extra
file goes before the prefix behind a `--- snippet ---` line. The code is tokenized as text:
a control token spelled in it stays text. A model without prefix, suffix and middle tokens
cannot infill: `infill_prompt` says which it lacks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratad.server.openai.requests import RequestError

if TYPE_CHECKING:
    from stratad.server.llama.requests import InfillRequest, LlamaCodec

SNIPPET = "\n\n--- snippet ---\n\n"  # between extra files, for a model without a file separator


def missing(codec: LlamaCodec) -> str | None:
    """Why the model cannot infill (None: it can), in llama-server's words."""
    fim = codec.fim
    roles = (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid))
    lacks = [f"{name} token is missing." for name, token in roles if token is None]
    return " ".join(lacks) or None


def infill_prompt(req: InfillRequest, codec: LlamaCodec) -> tuple[int, ...]:
    """The prompt's token ids; RequestError if the model has no FIM tokens."""
    why = missing(codec)
    if why is not None:
        raise RequestError(f"Infill is not supported by this model: {why}", None)
    fim = codec.fim
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    extra: list[int] = []
    if fim.rep is not None:
        extra += [fim.rep, *codec.encode_plain("myproject\n")]
    for chunk in req.input_extra:
        if fim.sep is not None:
            extra += [fim.sep, *codec.encode_plain(chunk.filename + "\n")]
        else:
            extra += codec.encode_plain(SNIPPET)
        extra += codec.encode_plain(chunk.text)
    if fim.sep is not None:
        extra += [fim.sep, *codec.encode_plain("filename\n")]
    bos = [codec.bos_id] if codec.add_bos and codec.bos_id is not None else []
    return (
        *extra, *bos, fim.pre, *codec.encode_plain(req.input_prefix),
        *codec.encode_plain(req.prompt), fim.suf, *codec.encode_plain(req.input_suffix), fim.mid,
    )  # fmt: skip
