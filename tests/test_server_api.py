"""The OpenAI request surface on the default model (SmolLM2-135M-Instruct), through the real
`openai` client: logit_bias, the penalties, logprobs, n, nulls, our 400 texts, token-id
prompts, unknown models, structured output and tools. One daemon serves every test here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from tests.server_helpers import Daemon, shared_daemon

MODEL = "default"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6}
TOKEN = 3000  # some ordinary token of SmolLM2's vocabulary


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("default")


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return daemon.client()


def _error(daemon: Daemon, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, raw = daemon.post(path, json.dumps(body).encode())
    return status, json.loads(raw)["error"] if status >= 400 else json.loads(raw)


def _most_repeated(text: str) -> int:
    words = re.findall(r"\w+", text)
    return max((words.count(w) for w in words), default=0)


def test_logit_bias(client: openai.OpenAI, daemon: Daemon) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text
    forced = client.completions.create(
        model=MODEL, prompt=prompt, logit_bias={str(TOKEN): 100}, **GREEDY
    ).choices[0].text
    # +100 makes one token the only choice at every step: the same piece six times
    piece = forced[: len(forced) // 6]
    assert forced != plain and piece and forced == piece * 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logit_bias={str(TOKEN): 100},
        **GREEDY,
    )
    assert chat.choices[0].message.content == piece * 6
    for bias, words in [
        ({"49152": 5}, "vocabulary has ids 0 to 49151"),
        ({"-1": 5}, "token -1"),
        ({"hello": 5}, "token ids written as strings"),
        ({"5": 101}, "logit_bias"),
    ]:
        status, err = _error(daemon, "/v1/completions", {"prompt": "x", "logit_bias": bias})
        assert status == 400 and err["param"].startswith("logit_bias"), err
        assert words in err["message"], err


def test_ignore_eos_decodes_to_max_tokens(client: openai.OpenAI) -> None:
    # +100 on <|im_end|> makes the end of sequence the greedy choice at every step
    ask: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "logit_bias": {"2": 100}, **GREEDY}
    ends = client.completions.create(**ask)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens == 1
    goes_on = client.completions.create(**ask, extra_body={"ignore_eos": True})
    assert goes_on.choices[0].finish_reason == "length"
    assert goes_on.usage.completion_tokens == GREEDY["max_tokens"]


def test_penalties(client: openai.OpenAI, daemon: Daemon) -> None:
    # greedy on a prompt that makes the model repeat itself; a frequency penalty breaks the loop
    prompt = "one one one one one one one one one one"
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 12}
    plain = client.completions.create(**args).choices[0].text
    freq = client.completions.create(frequency_penalty=2.0, **args).choices[0].text
    pres = client.completions.create(presence_penalty=2.0, **args).choices[0].text
    assert _most_repeated(plain) >= 3, plain
    assert _most_repeated(freq) < 3 and freq != plain, freq
    assert _most_repeated(pres) < 3 and pres != plain, pres
    status, err = _error(daemon, "/v1/completions", {"prompt": "x", "presence_penalty": 2.5})
    assert status == 400 and err["param"] == "presence_penalty"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=3, **GREEDY
    )
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0
        assert len(t.top_logprobs) == 3
        # greedy: the chosen token is the likeliest, and the list is sorted
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=3, stream=True, **GREEDY
    )
    streamed = [
        t for c in stream if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]  # fmt: skip
    # (the prompt's KV is reused now: the same numbers to float32 rounding)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None
    no_top = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, **GREEDY
    )
    assert no_top.choices[0].logprobs and no_top.choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)


def test_completion_logprobs(client: openai.OpenAI, daemon: Daemon) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top, key=top.__getitem__) == token
        assert top[token] == pytest.approx(logprob)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, logprobs=2, stream=True, **GREEDY
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens or []]  # fmt: skip
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset or []]  # fmt: skip
    assert tokens == lp.tokens and offsets == lp.text_offset
    status, err = _error(daemon, "/v1/completions", {"prompt": "x", "logprobs": 6})
    assert status == 400 and err["param"] == "logprobs"
    status, err = _error(
        daemon,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert status == 400 and err["param"] == "top_logprobs"


def test_n_choices(client: openai.OpenAI, daemon: Daemon) -> None:
    messages: Any = [{"role": "user", "content": "Name a fruit."}]
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    r = client.chat.completions.create(messages=messages, n=3, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts  # each choice its own draw
    one = client.chat.completions.create(messages=messages, n=1, **args)
    assert one.choices[0].message.content == texts[0]  # choice 0 is the n=1 answer
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    # each choice counts its own tokens (an end-of-sequence token too)
    assert one.usage.completion_tokens <= r.usage.completion_tokens <= 3 * 8
    chunks = list(
        client.chat.completions.create(
            messages=messages, n=3, stream=True, stream_options={"include_usage": True}, **args
        )
    )
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(3)]  # fmt: skip
    assert streamed == texts
    usage = chunks[-1].usage
    assert usage is not None  # (cached_tokens differ: the prompt is in the cache by now)
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        r.usage.prompt_tokens,
        r.usage.completion_tokens,
    )
    done = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert done == [0, 1, 2]
    text = client.completions.create(model=MODEL, prompt="Hello", n=2, **GREEDY)
    assert [c.index for c in text.choices] == [0, 1]
    assert text.choices[0].text == text.choices[1].text  # greedy: the same twice
    status, err = _error(daemon, "/v1/completions", {"prompt": "x", "n": 9})
    assert status == 400 and err["param"] == "n"


NULLABLE = [  # every optional field OpenAI's schema marks nullable, sent as null
    "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
    "frequency_penalty", "presence_penalty", "logit_bias", "user", "model",
]  # fmt: skip


def test_nulls_are_accepted(daemon: Daemon) -> None:
    base = {field: None for field in NULLABLE}
    chat = {**base, "messages": [{"role": "user", "content": "Hi", "name": None}],
            "max_completion_tokens": None, "logprobs": None, "top_logprobs": None}  # fmt: skip
    status, body = _error(daemon, "/v1/chat/completions", {**chat, "max_tokens": 3})
    assert status == 200 and body["choices"][0]["message"]["content"], body
    text = {**base, "prompt": "1, 2, 3, 4, 5, 6,", "echo": None, "logprobs": None,
            "suffix": None, "best_of": None}  # fmt: skip
    status, body = _error(daemon, "/v1/completions", text)  # sampled at the default 1.0
    assert status == 200 and 0 < body["usage"]["completion_tokens"] <= 16, body
    # greedy, a counting prompt goes on past the default limit (sampled, it may end sooner)
    status, body = _error(daemon, "/v1/completions", {**text, "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["completion_tokens"] == 16, body  # the default
    assistant = {"role": "assistant", "content": None}
    status, body = _error(daemon, "/v1/chat/completions", {**chat, "max_tokens": 3, "messages": [
        {"role": "user", "content": "Hi"}, assistant, {"role": "user", "content": "Hi"}]})
    assert status == 200, body


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"n": 9}, "n", "n must be at most 8"),
        ({"n": "two"}, "n", "n must be an integer or null, not a string"),
        ({"temperature": 3}, "temperature", "temperature must be at most 2"),
        ({"top_p": 0}, "top_p", "top_p must be greater than 0"),
        ({"stop": ["a"] * 5}, "stop", "stop must have at most 4 items"),
        ({"stop": "a" * 300}, "stop", "stop must have at most 256 characters"),
        ({"messages": []}, "messages", "messages must have at least 1 items"),
        ({"messages": None}, "messages", "messages must be a list, not null"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role",
         "messages[0].role may not be 'wizard' (it may be system, user, assistant, developer"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "messages[0].role is required"),
        ({"strata_prefix": {"x": 1}}, "strata_prefix.x", "strata_prefix.x is not a field"),
        ({"logit_bias": {"1": 200}}, "logit_bias", "logit_bias must be at most 100"),
    ],
)  # fmt: skip
def test_400_in_our_words(
    daemon: Daemon, body: dict[str, Any], param: str, message: str
) -> None:
    full = {"messages": [{"role": "user", "content": "x"}], **body}
    status, err = _error(daemon, "/v1/chat/completions", full)
    assert status == 400 and err["param"] == param, err
    assert err["message"].startswith(message), err
    assert "Expected" not in err["message"] and "$." not in err["message"], err


def test_token_id_prompts(client: openai.OpenAI, daemon: Daemon) -> None:
    text = "The capital of France is"
    _, tokens = _error(daemon, "/tokenize", {"content": text})
    ids = tokens["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    by_text = client.completions.create(model=MODEL, prompt=text, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], n=2, **GREEDY)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text == by_text.choices[0].text
    assert two.choices[2].text != two.choices[0].text
    assert two.usage is not None and two.usage.prompt_tokens == len(ids) + 2
    texts = client.completions.create(model=MODEL, prompt=[text, "Hello"], **GREEDY)
    assert texts.choices[0].text == by_text.choices[0].text and len(texts.choices) == 2
    for prompt, param in [([1, [2]], "prompt"), ([49152], "prompt"), ([[]], "prompt[0]")]:
        status, err = _error(daemon, "/v1/completions", {"prompt": prompt})
        assert status == 400 and err["param"] == param, err


def test_unknown_model_is_404(client: openai.OpenAI, daemon: Daemon) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-4o" in err["message"]
    served = client.models.list().data[0].id
    for name in (served, "default"):  # its id, and the default model's built-in alias
        r = client.completions.create(model=name, prompt="hi", max_tokens=1)
        assert r.model == served


def test_context_overflow_is_context_length_exceeded(
    client: openai.OpenAI, daemon: Daemon
) -> None:
    """OpenAI's `code` for what the context cannot hold, which LiteLLM and LangChain key on:
    a prompt too long (by its tokens, or by its bytes before tokenizing) and a max_tokens
    beyond what the prompt leaves; other 400s carry no code."""
    context = client.models.list().data[0].max_model_len  # type: ignore[attr-defined]
    cases = [
        ({"prompt": "word " * (context + 100)}, "prompt"),
        ({"prompt": "word " * 400_000}, "prompt"),  # 2 MB: refused by its byte count
        ({"prompt": "Hi", "max_tokens": context}, "max_tokens"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, **body)  # type: ignore[call-overload]
        err = info.value
        assert (err.code, err.param) == ("context_length_exceeded", param), err.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * (context + 100)}]
        )
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    status, err = _error(daemon, "/v1/completions", {"prompt": "Hi", "logit_bias": {"49152": 1}})
    assert status == 400 and err["param"] == "logit_bias" and err["code"] is None, err


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_on_every_draw(client: openai.OpenAI) -> None:
    import jsonschema
    fmt: Any = {"type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True}}  # fmt: skip
    messages: Any = [{"role": "user", "content": "Describe a person as JSON."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, n=4, temperature=1.0, seed=5,
        max_tokens=60,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    # the same unconstrained: not JSON of this schema (so the grammar is what made it so)
    free = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, seed=5, max_tokens=60
    )
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.choices[0].message.content or ""), PERSON)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, temperature=1.0, seed=5,
        max_tokens=60, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_json_object_mode(client: openai.OpenAI, daemon: Daemon) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=seed,
            max_tokens=80,
        )
        if r.choices[0].finish_reason == "stop":  # a reply cut at max_tokens is unfinished
            assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
        else:
            assert (r.choices[0].message.content or "").startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    status, err = _error(daemon, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "x"}], "response_format": bad})
    assert status == 400 and err["param"] == "response_format.json_schema.schema", err
    assert "objectx" in err["message"]


# schemas a client may send that no reply can follow, or too large to compile in bounded time
SCHEMAS_REFUSED: dict[str, Any] = {
    "recursive": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                  "required": ["next"]}}, "$ref": "#/$defs/n"},
    "cyclic": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
               "$ref": "#/$defs/a"},
    "nested quantifier": {"type": "string", "pattern": "^a{1000}{1000}$"},
    # clamped to 2^63 - 1: a 200 whose value the schema refuses; clamped to -2^63: SIGSEGV
    "integer past 2^63": {"type": "integer", "minimum": 1e300, "maximum": 1e301},
    "integer past -2^63": {"type": "integer", "minimum": -1e301, "maximum": -1e300},
    "600 optional": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                      for i in range(600)}},
    "15,000 required": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                         for i in range(15_000)},
                        "required": [f"p{i}" for i in range(15_000)]},
}  # fmt: skip


def test_unfollowable_schemas_are_the_clients_400(daemon: Daemon) -> None:
    """Each schema of the corpus is answered 400 naming the schema, before generation (they
    were 500s after the first sampled token, or 200 with empty content for the cycle), and
    the same through a forced tool's parameters; /health answers within a second while they
    compile."""
    import threading
    import time

    slowest: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert daemon.get("/health")[0] == 200
            slowest.append(time.monotonic() - t)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for name, schema in SCHEMAS_REFUSED.items():
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            status, err = _error(daemon, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x"}], "response_format": fmt,
                "max_tokens": 4})  # fmt: skip
            assert status == 400, (name, status, err)
            assert err["param"].startswith("response_format"), (name, err)
            assert "<" not in err["message"], err  # no parser state dump
            tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
            status, err = _error(daemon, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x"}], "tools": [tool],
                "tool_choice": "required", "max_tokens": 4})  # fmt: skip
            assert status == 400, (name, "tools", status, err)
    finally:
        done.set()
        poller.join()
    assert slowest and max(slowest) < 1.0, max(slowest)


def test_a_tool_schema_nested_too_deep_is_400(daemon: Daemon) -> None:
    """An offered tool's schema (not forced: the template writes it) nested 300 deep is the
    client's 400 naming it, not a RecursionError in the template."""
    deep = json.loads('{"type": "object", "properties": {"a": ' * 150 + "{}" + "}}" * 150)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "max_tokens": 2}
    status, err = _error(daemon, "/v1/chat/completions", body)
    assert status == 400 and err["param"] == "tools[0].function.parameters", err
    assert "nested" in err["message"], err


def test_unsupported_fields_are_refused_or_logged_once(daemon: Daemon) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    function = {"name": "f", "parameters": {"type": "object"}}
    for extra, param in [
        ({"functions": [function]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
    ]:
        status, err = _error(daemon, "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and err["param"] == param, err
    for extra in [{"store": True}, {"metadata": {"a": "b"}}, {"strata_nonsense": 1},
                  {"tools": None}, {"modalities": ["text"]}]:  # fmt: skip
        for _ in range(2):
            status, body = _error(daemon, "/v1/chat/completions", {**chat, **extra})
            assert status == 200, body
    log = daemon.log.read_text()
    for name in ("store", "metadata", "strata_nonsense"):
        assert log.count(f"request field '{name}' is ignored") == 1, log[-2000:]
    assert "request field 'tools'" not in log
