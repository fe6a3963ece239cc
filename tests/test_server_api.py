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
