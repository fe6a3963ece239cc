"""llama-server's request bodies (`/completion`, `/infill`, `/apply-template`) and their
translation into engine `Job`s, with llama-server's field names and defaults.

A prompt is text, token ids, or a mix (`[12, " text", 34]`: the text tokenized in place, BOS
before it only if it comes first and the model asks for BOS); a list without numbers holds
several prompts, each answered in turn. llama-server's samplers that Strata does not have
(`repeat_penalty`, `mirostat`, DRY, XTC, ...) are accepted at their neutral value and refused
with a 400 naming them otherwise; settings that change nothing here (`cache_prompt`: prefix
reuse is automatic, `n_keep`, `id_slot`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

import msgspec

from stratad.model.text.fim import FimTokens
from stratad.runtime.jobs import Job
from stratad.server import fields, structured
from stratad.server.openai import requests as oa
from stratad.server.openai.requests import RequestError
from stratad.server.tokens import TextCodec

# llama-server's defaults for /completion (its README and GET /props)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
MAX_STOP = 16
MAX_PROMPTS = oa.MAX_CHOICES
MAX_PROBS = 20
# llama-server's samplers and options that Strata has not: accepted at these values only
NEUTRAL: dict[str, Any] = {
    "repeat_penalty": 1.0, "typical_p": 1.0, "mirostat": 0, "dynatemp_range": 0.0,
    "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0, "n_indent": 0,
    "t_max_predict_ms": 0, "post_sampling_probs": False,
    "response_fields": [], "lora": [], "return_progress": False, "n_cmpl": 1, "n_probs_min": 0,
    "tfs_z": 1.0, "penalize_nl": False, "multimodal_data": [],
}  # fmt: skip
# settings that change nothing here (their samplers are off, or the work is automatic)
IGNORED = frozenset({
    "cache_prompt", "n_keep", "id_slot", "slot_id", "n_cache_reuse", "repeat_last_n",
    "mirostat_tau", "mirostat_eta", "dynatemp_exponent", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "xtc_threshold", "min_keep", "samplers",
    "sse_ping_interval", "penalty_prompt_tokens", "use_penalty_prompt_tokens", "n_discard",
})  # fmt: skip


class LlamaCodec(TextCodec, Protocol):
    """What llama-server's routes need of the tokenizer
    (`stratad.model.text.tokenizer.Tokenizer`)."""

    add_bos: bool
    bos_id: int | None
    fim: FimTokens
    chat_template: str | None

    def encode_plain(self, text: str) -> list[int]: ...

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


Part = int | str
PromptValue = Annotated[str, msgspec.Meta(min_length=1)] | Annotated[
    list[Part | list[Part]], msgspec.Meta(min_length=1)
]
Stop = oa.StopString | Annotated[list[oa.StopString], msgspec.Meta(max_length=MAX_STOP)] | None
# [[token id or text, bias or false], ...], or OpenAI's {"token id": bias}
LogitBias = list[list[int | str | float | bool]] | dict[str, float | bool] | None


class CompletionRequest(_Struct, frozen=True):
    """POST /completion: llama-server's completion (its field names and defaults)."""

    prompt: PromptValue
    """text, token ids, a mix of both, or a list of such prompts"""
    n_predict: Annotated[int, msgspec.Meta(ge=-1, le=oa.TOKENS_MAX)] | None = None
    """tokens to generate at most; -1 (the default): until the end or the context is full"""
    temperature: float | None = None
    """default 0.8; 0 or below is greedy"""
    top_k: int | None = None
    """default 40; 0 or below disables"""
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    """default 0.95"""
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    """default 0.05"""
    seed: Annotated[int, msgspec.Meta(ge=-1, le=oa.SEED_MAX)] | None = None
    """-1 (the default): random"""
    stop: Stop = None
    stream: bool = False
    n_probs: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBS)] = 0
    """the likeliest N tokens at each step, in `completion_probabilities`"""
    presence_penalty: oa.Penalty | None = None
    frequency_penalty: oa.Penalty | None = None
    logit_bias: LogitBias = None
    ignore_eos: bool = False
    """decode past end-of-sequence tokens, to `n_predict`"""
    grammar: str | None = None
    """GBNF the output must follow"""
    json_schema: dict[str, Any] | None = None
    """a JSON schema the output must follow"""
    timings_per_token: bool = False
    """`timings` in every streamed chunk, not only the last"""
    return_tokens: bool = False
    """the generated token ids in `tokens`"""
    cache_prompt: bool = True
    """accepted: a cached prefix is reused whenever it can be"""
    model: str | None = None


class InfillChunk(_Struct, frozen=True, forbid_unknown_fields=True):
    """A file of context for /infill."""

    text: str
    filename: str = "tmp"


class InfillRequest(CompletionRequest, frozen=True, kw_only=True):
    """POST /infill: fill in between `input_prefix` and `input_suffix` (with every option of
    /completion)."""

    input_prefix: str
    input_suffix: str
    input_extra: list[InfillChunk] = []
    """other files, put before the prefix"""
    prompt: str = ""  # type: ignore[assignment]
    """text that continues the prefix (e.g. the line being typed)"""


class ApplyTemplateRequest(_Struct, frozen=True):
    """POST /apply-template: a conversation, as in /v1/chat/completions."""

    messages: Annotated[list[oa.Message], msgspec.Meta(min_length=1)]
    tools: oa.tt.Tools | None = None
    add_generation_prompt: bool = True
    model: str | None = None


class PromptText(_Struct, frozen=True):
    """The prompt the chat template makes of the conversation."""

    prompt: str


# --- prompts -------------------------------------------------------------------------------


def _mixed(parts: list[Part], codec: LlamaCodec) -> tuple[int, ...]:
    """A prompt of token ids and texts: each text tokenized in place, BOS only before a first
    text (llama-server's `tokenize_mixed`)."""
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            ids += codec.encode(part, add_special=i == 0)
        else:
            ids.append(part)
    return tuple(ids)


def _one(value: str | list[Part], codec: LlamaCodec) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if all(isinstance(p, int) for p in value):
        return tuple(value)  # type: ignore[arg-type]
    return _mixed(value, codec)


def prompts(value: PromptValue, codec: LlamaCodec) -> list[str | tuple[int, ...]]:
    """The prompts of `prompt`: a list holding numbers is one prompt, else one per item."""
    if isinstance(value, str) or any(isinstance(p, int) for p in value):
        if not isinstance(value, str) and any(isinstance(p, list) for p in value):
            raise RequestError(
                "prompt mixes token ids with lists; give one prompt (ids and texts) or a list"
                " of prompts", "prompt",
            )  # fmt: skip
        return [_one(value, codec)]  # type: ignore[arg-type]
    if len(value) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        if isinstance(item, list) and any(isinstance(p, list) for p in item):
            raise RequestError("a prompt is text, token ids or a mix", f"prompt[{i}]")
        if item == "" or item == []:
            raise RequestError("a prompt may not be empty", f"prompt[{i}]")
        out.append(_one(item, codec))  # type: ignore[arg-type]
    return out


# --- options -------------------------------------------------------------------------------


def check_fields(body: bytes, known: frozenset[str]) -> None:
    """Refuse llama-server's samplers that Strata has not, unless at their neutral value; let
    the ignored ones pass; the rest as the OpenAI routes treat unknown fields."""
    try:
        given = msgspec.json.decode(body, type=dict[str, Any])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    for name, value in given.items():
        if name in NEUTRAL and value is not None and value != NEUTRAL[name]:
            raise RequestError(
                f"{name} is not supported here (llama-server's sampler or option; only its"
                f" neutral value {msgspec.json.encode(NEUTRAL[name]).decode()} is accepted)",
                name,
            )
    fields.check(body, known | IGNORED | frozenset(NEUTRAL))


def _logit_bias(bias: LogitBias, codec: LlamaCodec) -> tuple[tuple[int, float], ...]:
    """llama-server's forms: `[[id or text, bias or false], ...]` or `{"id": bias}`; a text
    biases each of its tokens, `false` bans the token."""
    pairs: list[tuple[Any, Any]]
    if bias is None:
        return ()
    if isinstance(bias, dict):
        pairs = list(bias.items())
    else:
        if any(len(p) != 2 for p in bias):
            raise RequestError("logit_bias entries are [token, bias] pairs", "logit_bias")
        pairs = [(p[0], p[1]) for p in bias]
    out: list[tuple[int, float]] = []
    for key, value in pairs:
        if value is True or not isinstance(value, int | float):
            raise RequestError("a logit_bias is a number, or false to ban the token",
                               "logit_bias")  # fmt: skip
        amount = float("-inf") if value is False else float(value)
        if isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(bias, dict):
            out.append((int(key), amount))
        elif isinstance(key, str):
            out += [(t, amount) for t in codec.encode(key, add_special=False)]
        elif isinstance(key, int) and not isinstance(key, bool):
            out.append((key, amount))
        else:
            raise RequestError("a logit_bias token is an id or a text", "logit_bias")
    return tuple(out)


def _grammar(req: CompletionRequest) -> tuple[str | None, str]:
    if req.grammar and req.json_schema is not None:
        raise RequestError("give grammar or json_schema, not both", "grammar")
    if req.grammar:
        return structured.gbnf_grammar(req.grammar, "grammar"), "grammar"
    if req.json_schema is not None:
        return structured.json_grammar(req.json_schema, "json_schema"), "json_schema"
    return None, "grammar"


def jobs_of(
    req: CompletionRequest,
    prompts: list[str | tuple[int, ...]],
    codec: LlamaCodec,
    default_max_tokens: int | None,
) -> list[Job]:
    """One job per prompt, with llama-server's defaults for what the request leaves out."""
    if req.n_predict == 0:
        raise RequestError("n_predict 0 (evaluate the prompt only) is not supported; give at"
                           " least 1, or -1 for no limit", "n_predict")  # fmt: skip
    temperature = DEFAULTS["temperature"] if req.temperature is None else req.temperature
    top_k = int(DEFAULTS["top_k"]) if req.top_k is None else req.top_k
    grammar, param = _grammar(req)
    common = {
        "max_tokens": default_max_tokens if req.n_predict in (None, -1) else req.n_predict,
        # llama-server samples greedily at a temperature of 0 or below
        "temperature": temperature if temperature >= oa.MIN_TEMPERATURE else 0.0,
        "top_k": max(top_k, 0),
        "top_p": max(DEFAULTS["top_p"] if req.top_p is None else req.top_p, oa.MIN_TOP_P),
        "min_p": DEFAULTS["min_p"] if req.min_p is None else req.min_p,
        "seed": None if req.seed in (None, -1) else req.seed,
        "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "logit_bias": _logit_bias(req.logit_bias, codec),
        "ignore_eos": req.ignore_eos,
        "logprobs": req.n_probs or None,
        "grammar": grammar,
        "grammar_param": param,
    }
    return [
        Job(
            prompt=p if isinstance(p, str) else None,
            prompt_ids=None if isinstance(p, str) else p,
            **common,  # type: ignore[arg-type]
        )
        for p in prompts
    ]
