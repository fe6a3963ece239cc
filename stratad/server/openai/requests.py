"""OpenAI request schemas (msgspec) and their translation into engine `Job`s (the responses:
`stratad.server.openai.responses`).

The request structs carry their bounds as `msgspec.Meta`, so decoding is the validation and
the OpenAPI description (`stratad.server.openapi`) is generated from the same types. What a
schema cannot say (unsupported options set to non-default values) `to_job` checks, raising
`RequestError` with the field's path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from stratad.grammars import too_large
from stratad.protocol import Health as Health  # /health's body, shared with stratactl status
from stratad.runtime import jobs
from stratad.runtime.jobs import ChatMessage, Job
from stratad.server.tools import types as tt

MAX_STOP = 4
MAX_N = 8  # choices per prompt
MAX_CHOICES = 16  # choices per request (prompts times n)
MIN_TEMPERATURE = 1e-5  # lower temperatures are served greedily
MIN_TOP_P = 1e-6
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # int64, what torch.Generator.manual_seed takes
TOKENS_MAX = 1 << 20

Tokens = Annotated[int, msgspec.Meta(ge=1, le=TOKENS_MAX)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0, description="0 is greedy")]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=TOKENS_MAX, description="0 or -1 disables")]
# JSON Schema's integer admits 0.0; a whole number written as a float is taken as one
TopKFloat = Annotated[float, msgspec.Meta(ge=-1, le=TOKENS_MAX)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=SEED_MIN, le=SEED_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, msgspec.Meta(max_length=256)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP)] | None
Count = Annotated[int, msgspec.Meta(ge=0, le=TOKENS_MAX)]
MAX_LOGIT_BIAS = 1024
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[str, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]


class RequestError(ValueError):
    """A request that decodes but cannot be served as asked; `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class TextPart(_Struct, frozen=True):
    type: Literal["text"]
    text: str


class Message(_Struct, frozen=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[tt.ToolCall] | None = None
    """an assistant's calls (its content may then be null)"""
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """an assistant's earlier reasoning, as the answer gave it: a template that writes it back
    reads it (gpt-oss's, as `thinking`)"""
    """a `tool` message: the id of the call it answers"""


class JsonSchemaFormat(_Struct, frozen=True):
    name: Annotated[str, msgspec.Meta(max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None
    """the schema is enforced either way"""


class ResponseFormat(_Struct, frozen=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False


class StrataPrefix(_Struct, frozen=True, forbid_unknown_fields=True):
    """Pin the KV of a shared prefix so later requests that start with it reuse it."""

    messages: Count | None = None
    """the first N messages (chat only)"""
    tokens: Count | None = None
    """the first N prompt tokens"""


class _Sampling(_Struct, frozen=True):
    # Every optional field takes an explicit null (OpenAI's schema marks them nullable):
    # null means the default.
    model: str | None = None
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    """default 1"""
    top_p: TopP | None = None
    """default 1"""
    top_k: TopK | TopKFloat | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    """default 1"""
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    user: str | None = None
    strata_prefix: StrataPrefix | None = None
    logit_bias: LogitBias | None = None
    """token id (as a string) -> added to its logit before sampling, -100 to 100"""
    response_format: ResponseFormat | None = None
    """json_object or json_schema: the output follows it, token by token"""
    timings_per_token: bool | None = None
    """llama-server's: the answer, and each streamed chunk, carries `timings`"""
    ignore_eos: bool | None = None
    """vLLM's and llama-server's: decode past end-of-sequence tokens to `max_tokens`"""


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: tt.Tools | None = None
    """functions the model may call, written into the prompt by the chat template"""
    tool_choice: tt.ToolChoice = None


TokenIds = Annotated[list[int], msgspec.Meta(min_length=1)]
# One prompt (text, or token ids), or a list of prompts (texts, or lists of token ids): a
# JSON Schema union allows one array type, so the list's items are checked in `prompts_of`.
Prompt = Annotated[str, msgspec.Meta(min_length=1)] | Annotated[
    list[str | int | TokenIds], msgspec.Meta(min_length=1)
]


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    prompt: Prompt
    echo: bool | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    suffix: str | None = None


def _content(m: Message) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(
                f"logit_bias keys are token ids written as strings, not {key[:32]!r}",
                "logit_bias",
            ) from None
        out.append((token, value))
    return tuple(out)


def _common(req: _Sampling) -> dict[str, object]:
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options needs stream=true", "stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    top_k = req.top_k or 0
    if not float(top_k).is_integer():
        raise RequestError(f"top_k must be a whole number, not {top_k}", "top_k")
    temperature = 1.0 if req.temperature is None else req.temperature
    return {
        # The sampler computes in float32: a temperature or top_p that underflows there turns
        # the distribution into NaN. Below these floors both already mean "the top token".
        "temperature": temperature if temperature >= MIN_TEMPERATURE else 0.0,
        "top_p": max(1.0 if req.top_p is None else req.top_p, MIN_TOP_P),
        "top_k": max(int(top_k), 0),
        "min_p": req.min_p or 0.0,
        "seed": req.seed,
        "stop": stop,
        "logit_bias": _logit_bias(req.logit_bias),
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "ignore_eos": bool(req.ignore_eos),
        "prefix_tokens": (req.strata_prefix.tokens or 0) if req.strata_prefix else 0,
    }


def chat_message(m: Message, i: int) -> ChatMessage:
    """A request message as the engine takes it (`i`: its index, for errors)."""
    if m.role == "tool" and not m.tool_call_id:
        raise RequestError("a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
    if m.tool_calls and m.role != "assistant":
        raise RequestError("only assistant messages make tool calls", f"messages[{i}].tool_calls")
    calls = tuple(
        jobs.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
        for c in m.tool_calls or ()
    )
    role = "system" if m.role == "developer" else m.role
    return ChatMessage(role, _content(m), tool_calls=calls, tool_call_id=m.tool_call_id,
                       reasoning=m.reasoning_content or "")  # fmt: skip


def chat_job(req: ChatCompletionRequest, default_max_tokens: int | None) -> Job:
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    messages = tuple(chat_message(m, i) for i, m in enumerate(req.messages))
    for i, t in enumerate(req.tools or ()):  # a template writes them: bounded before it does
        why = too_large(t.function.parameters) if t.function.parameters is not None else None
        if why is not None:
            param = f"tools[{i}].function.parameters"
            raise RequestError(f"{param} is too large a JSON schema: {why}", param)
    tools = tuple(
        jobs.Tool(t.function.name, t.function.description, t.function.parameters)
        for t in req.tools or ()
    )
    prefix = req.strata_prefix
    return Job(
        messages=messages,
        tools=tools,
        max_tokens=req.max_completion_tokens or req.max_tokens or default_max_tokens,
        prefix_messages=(prefix.messages or 0) if prefix else 0,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        **_common(req),  # type: ignore[arg-type]
    )


def choices(job: Job, n: int) -> list[Job]:
    """`n` jobs for the `n` choices of one prompt; a seed gives choice i the seed + i."""
    if job.seed is None:
        return [job] * n
    return [
        msgspec.structs.replace(job, seed=(job.seed + i - SEED_MIN) % (1 << 64) + SEED_MIN)
        for i in range(n)
    ]


def prompts_of(
    prompt: str | list[str | int | list[int]], param: str = "prompt"
) -> list[str | tuple[int, ...]]:
    """The prompts of a `Prompt` field named `param`: texts or token-id tuples."""
    if isinstance(prompt, str):
        return [prompt]
    kinds = {type(p) for p in prompt}
    if kinds == {int}:
        return [tuple(prompt)]  # type: ignore[arg-type]
    if kinds == {str}:
        return list(prompt)  # type: ignore[arg-type]
    if kinds == {list}:
        return [tuple(p) for p in prompt]  # type: ignore[arg-type]
    raise RequestError(
        f"{param} must be a string, a list of strings, a list of token ids or a list of such"
        " lists, not a mix",
        param,
    )


def completion_jobs(req: CompletionRequest) -> list[Job]:
    """The jobs of every choice: `n` per prompt, prompt by prompt."""
    if req.echo:
        raise RequestError("echo is not supported", "echo")
    if req.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if req.strata_prefix is not None and req.strata_prefix.messages:
        raise RequestError("a completion has no messages; pin tokens", "strata_prefix.messages")
    prompts, n = prompts_of(req.prompt), req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(
            f"{len(prompts)} prompts times n={n} make {len(prompts) * n} choices; at most"
            f" {MAX_CHOICES}",
            "prompt" if n == 1 else "n",
        )
    common = _common(req)
    jobs = []
    for prompt in prompts:
        job = Job(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_ids=None if isinstance(prompt, str) else prompt,
            max_tokens=req.max_tokens or 16,
            logprobs=req.logprobs,
            **common,  # type: ignore[arg-type]
        )
        jobs += choices(job, n)
    return jobs
