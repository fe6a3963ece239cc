"""llama-server's answers to `/completion` and `/infill`: one result object per prompt, or,
streamed, one `data: {...}` event per new piece of text (`stop: false`) and a last one per
prompt (`stop: true`) with the counts, the stop type and `timings`. As llama-server does, a
stream ends without `data: [DONE]`, and a request of several prompts gets a list of results.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from aiohttp import web

from stratad.runtime.jobs import Delta, Job, JobError, TokenLogprob
from stratad.runtime.scheduler import EngineFailed, Ticket
from stratad.server.finished import CANCELLED, Unfinished, deltas_of
from stratad.server.http.sse import ClientGone, EventStream
from stratad.server.llama.requests import DEFAULTS
from stratad.server.llama.timings import Timings, timings_of
from stratad.server.openai import responses as rs

SLOT = -1  # the `id_slot` of every answer: requests are placed by the scheduler, not by slot
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]  # Strata's order (vLLM's)


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class Params(_Struct, frozen=True):
    """The settings a completion ran with (llama-server's `generation_settings`)."""

    n_predict: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    stop: list[str]
    max_tokens: int
    n_probs: int
    stream: bool
    grammar: str
    timings_per_token: bool
    samplers: list[str]
    repeat_penalty: float = 1.0
    typical_p: float = 1.0
    mirostat: int = 0
    n_keep: int = 0
    ignore_eos: bool = False


def params_of(job: Job | None, stream: bool = False, timings_per_token: bool = False) -> Params:
    """A job's settings; None: the defaults of /completion."""
    if job is None:
        job = Job(max_tokens=None, temperature=DEFAULTS["temperature"],
                  top_k=int(DEFAULTS["top_k"]), top_p=DEFAULTS["top_p"],
                  min_p=DEFAULTS["min_p"])  # fmt: skip
    n_predict = -1 if job.max_tokens is None else job.max_tokens
    return Params(
        n_predict=n_predict,
        seed=-1 if job.seed is None else job.seed,
        temperature=job.temperature,
        top_k=job.top_k,
        top_p=job.top_p,
        min_p=job.min_p,
        presence_penalty=job.presence_penalty,
        frequency_penalty=job.frequency_penalty,
        stop=list(job.stop),
        max_tokens=n_predict,
        n_probs=job.logprobs or 0,
        stream=stream,
        ignore_eos=job.ignore_eos,
        grammar="" if job.grammar is None else job.grammar,
        timings_per_token=timings_per_token,
        samplers=SAMPLERS,
    )


class TopProb(_Struct, frozen=True):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class TokenProbs(_Struct, frozen=True):
    """One generated token and the likeliest tokens at its step."""

    id: int
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopProb]


def probs(tokens: list[TokenLogprob]) -> list[TokenProbs]:
    return [
        TokenProbs(
            id=t.id,
            token=t.token,
            bytes=list(t.bytes),
            logprob=t.logprob,
            top_logprobs=[
                TopProb(id=a.id, token=a.token, bytes=list(a.bytes), logprob=a.logprob)
                for a in t.top
            ],
        )
        for t in tokens
    ]


class Partial(_Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A streamed piece of a completion."""

    index: int
    content: str
    tokens: list[int]
    stop: Literal[False]
    id_slot: int
    tokens_predicted: int
    tokens_evaluated: int
    completion_probabilities: list[TokenProbs] | None = None
    timings: Timings | None = None


class Result(_Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A finished completion (the last event of a stream, with empty `content`)."""

    index: int
    content: str
    tokens: list[int]
    id_slot: int
    stop: Literal[True]
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: Params
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: Literal["eos", "limit", "word"]
    stopping_word: str
    stopped_eos: bool
    """the older llama-server's form of `stop_type`"""
    stopped_word: bool
    stopped_limit: bool
    tokens_cached: int
    timings: Timings
    completion_probabilities: list[TokenProbs] | None = None


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """What a /completion answer needs beside its tickets."""

    model: str
    stream: bool
    timings_per_token: bool
    return_tokens: bool
    prompts: list[str]
    """each prompt's text (token ids decoded), for `prompt`"""


def _stop_type(last: Delta) -> Literal["eos", "limit", "word"]:
    if last.finish_reason == "length":
        return "limit"
    return "word" if last.stopping_word else "eos"


def _generated(d: Delta) -> list[int]:
    """The token of a delta, unless it is the end-of-sequence token that ended the reply."""
    if d.token is None or (d.finish_reason == "stop" and not d.stopping_word):
        return []
    return [d.token]


def _result(
    a: Answer, ticket: Ticket, index: int, last: Delta, text: str, tokens: list[int],
    logprobs: list[TokenLogprob] | None,
) -> Result:  # fmt: skip
    stop = _stop_type(last)
    return Result(
        index=index,
        content=text,
        tokens=tokens if a.return_tokens else [],
        id_slot=SLOT,
        stop=True,
        model=a.model,
        tokens_predicted=last.completion_tokens,
        tokens_evaluated=last.prompt_tokens,
        generation_settings=params_of(ticket.prepared.job, a.stream, a.timings_per_token),
        prompt=a.prompts[index],
        has_new_line="\n" in text,
        truncated=False,
        stop_type=stop,
        stopping_word=last.stopping_word,
        stopped_eos=stop == "eos",
        stopped_word=stop == "word",
        stopped_limit=stop == "limit",
        tokens_cached=last.prompt_tokens + last.completion_tokens,
        timings=timings_of([(ticket, last)]),
        completion_probabilities=probs(logprobs) if logprobs is not None else None,
    )


def _json(body: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def collect(a: Answer, tickets: list[Ticket]) -> web.Response:
    results: list[Result] = []
    for i, ticket in enumerate(tickets):
        try:
            deltas = await deltas_of(ticket)
        except Unfinished as e:
            return e.response
        tokens = [t for d in deltas for t in _generated(d)]
        logprobs = [d.logprobs for d in deltas if d.logprobs is not None]
        asked = ticket.prepared.job.logprobs is not None
        results.append(_result(a, ticket, i, deltas[-1], "".join(d.text for d in deltas),
                               tokens, logprobs if asked else None))  # fmt: skip
    return _json(results[0] if len(results) == 1 else results)


async def stream(events: EventStream, a: Answer, tickets: list[Ticket]) -> web.StreamResponse:
    """Each prompt's events in turn; no `[DONE]` at the end (llama-server sends none)."""
    try:
        await events.open()
        for i, ticket in enumerate(tickets):
            if not await _stream_one(events, a, ticket, i):
                for rest in tickets[i + 1 :]:
                    rest.cancel()
                break
        await events.end()
    except ClientGone:
        for t in tickets:
            t.cancel()
    return events.response


async def _stream_one(events: EventStream, a: Answer, ticket: Ticket, index: int) -> bool:
    last: Delta | None = None
    try:
        async for d in ticket.stream():
            last = d
            if d.text or d.logprobs is not None:
                await events.send(Partial(
                    index=index,
                    content=d.text,
                    tokens=_generated(d),
                    stop=False,
                    id_slot=SLOT,
                    tokens_predicted=d.completion_tokens,
                    tokens_evaluated=d.prompt_tokens,
                    completion_probabilities=probs([d.logprobs]) if d.logprobs else None,
                    timings=timings_of([(ticket, d)]) if a.timings_per_token else None,
                ))  # fmt: skip
    except (EngineFailed, JobError) as e:
        await events.send(msgspec.json.decode(rs.error_body(str(e), "server_error", None)))
        return False
    if last is None or not last.finish_reason:  # cancelled by a drain, not the client
        gone = CANCELLED
        await events.send(msgspec.json.decode(rs.error_body(gone, "server_error", None)))
        return False
    await events.send(_result(a, ticket, index, last, "", [], None))
    return True

