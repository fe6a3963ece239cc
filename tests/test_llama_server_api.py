"""llama-server's native API on the shared tiny-moe daemon, spoken with httpx as llama-server's
clients speak it (its field names): /completion (answered, streamed, token-id, mixed and
several prompts, n_probs, timings, GBNF and JSON-schema grammars), /props, /slots,
/apply-template, /infill, and `timings` on /v1 answers when asked."""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from stratad.model.formats.gguf import GGUFReader, gguf_metadata
from stratad.model.text.fim import find_fim, gguf_declared
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.server.llama.infill import infill_prompt
from stratad.server.llama.requests import InfillChunk, InfillRequest
from tests.server_helpers import API_KEY, Daemon, shared_daemon, tiny_moe_path

TIMINGS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}  # fmt: skip
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("tiny")


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, headers=AUTH, timeout=120) as client:
        yield client


def _complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """The `data:` events of a stream (and, as a string, any line that is not one)."""
    out: list[Any] = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            out.append(json.loads(line[6:]) if line.startswith("data: {") else line)
    return out


def test_completion_answers_with_timings_and_probabilities(http: httpx.Client) -> None:
    body = _complete(http, prompt="The capital of France is", n_predict=4, temperature=0,
                     n_probs=3, cache_prompt=True)  # fmt: skip
    assert isinstance(body["content"], str) and body["stop"] is True
    assert body["tokens_predicted"] <= 4 and body["tokens_evaluated"] > 0
    assert body["stop_type"] in ("eos", "limit", "word") and body["stopping_word"] == ""
    assert body["stopped_limit"] == (body["stop_type"] == "limit")
    assert set(body["timings"]) == TIMINGS
    t = body["timings"]
    assert t["predicted_n"] == body["tokens_predicted"] and t["prompt_ms"] > 0
    assert t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"]
    assert body["generation_settings"]["n_predict"] == 4
    assert body["generation_settings"]["n_probs"] == 3
    assert body["prompt"] == "The capital of France is"
    probs = body["completion_probabilities"]
    generated = body["tokens_predicted"] - (body["stop_type"] == "eos")
    assert len(probs) == generated
    for p in probs:
        assert isinstance(p["id"], int) and p["logprob"] <= 0 and len(p["top_logprobs"]) == 3
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the likeliest was drawn
        assert bytes(p["bytes"]).decode(errors="replace") == p["token"]
    assert "".join(p["token"] for p in probs) == body["content"]


def test_completion_streams_in_llama_servers_shape(http: httpx.Client) -> None:
    ask = {"prompt": "Once upon a time", "n_predict": 5, "temperature": 0}
    whole = _complete(http, **ask)
    events = _events(http, "/completion", {**ask, "stream": True, "timings_per_token": True,
                                           "n_probs": 1})  # fmt: skip
    assert all(isinstance(e, dict) for e in events), events  # no `data: [DONE]`
    *parts, last = events
    assert parts and all(e["stop"] is False for e in parts)
    assert all(set(e["timings"]) == TIMINGS for e in parts)
    assert all(len(e["tokens"]) <= 1 and len(e["completion_probabilities"]) == 1 for e in parts)
    assert "".join(e["content"] for e in parts) == whole["content"]
    assert last["stop"] is True and last["content"] == ""
    assert last["stop_type"] == whole["stop_type"] and last["timings"]["predicted_n"] >= 1
    assert last["tokens_predicted"] == whole["tokens_predicted"]


def test_token_id_and_mixed_prompts(http: httpx.Client) -> None:
    def ids(text: str) -> list[int]:
        r = http.post("/tokenize", json={"content": text})
        return list(r.json()["tokens"])

    head, tail = ids("Hello"), ids(" world, how are you")
    greedy = {"n_predict": 3, "temperature": 0, "return_tokens": True}
    by_ids = _complete(http, prompt=head + tail, **greedy)
    mixed = _complete(http, prompt=[*head, " world, how are you"], **greedy)
    assert by_ids["tokens_evaluated"] == mixed["tokens_evaluated"] == len(head) + len(tail)
    assert mixed["content"] == by_ids["content"] and mixed["tokens"] == by_ids["tokens"]
    assert mixed["prompt"] == "Hello world, how are you"
    several = http.post("/completion", json={"prompt": ["Hi", [*head]], "n_predict": 2})
    assert several.status_code == 200, several.text
    assert [r["index"] for r in several.json()] == [0, 1]
    bad = http.post("/completion", json={"prompt": [1, 10**9], "n_predict": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_gbnf_grammar_constrains_the_output(http: httpx.Client) -> None:
    for seed in range(3):
        body = _complete(http, prompt="Is water wet?", n_predict=8, temperature=1.0, seed=seed,
                         grammar='root ::= "yes" | "no"')  # fmt: skip
        assert body["content"] in ("yes", "no"), body["content"]
        assert body["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    body = _complete(http, prompt="JSON:", n_predict=16, json_schema=schema)
    assert json.loads(body["content"])["a"] in ("x", "y")


@pytest.mark.parametrize(
    ("grammar", "words"),
    [('root ::= "yes', "GBNF"), ("root ::= answer", "answer"), ('x ::= "a"', "root"),
     # Lark embedding a schema whose compile crashes llguidance (SIGSEGV): the daemon's check
     # runs it in a process of its own, whose end refuses it
     ('start: %json {"type": "integer", "minimum": -1e301, "maximum": -1e300}', "ended")],
)
def test_an_invalid_grammar_is_a_400_before_generation(
    http: httpx.Client, daemon: Daemon, grammar: str, words: str
) -> None:
    before = daemon.metrics().get("strata:request_success_total", 0.0)
    r = http.post("/completion", json={"prompt": "Hi", "n_predict": 4, "grammar": grammar})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "grammar" and words in error["message"], error
    assert daemon.metrics().get("strata:request_success_total", 0.0) == before


def test_samplers_strata_lacks_are_refused_unless_neutral(http: httpx.Client) -> None:
    r = http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "repeat_penalty": 1.3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repeat_penalty"
    neutral = {"repeat_penalty": 1.0, "mirostat": 0, "typical_p": 1.0, "n_keep": 0,
               "id_slot": -1, "samplers": ["top_k", "temperature"]}  # fmt: skip
    assert _complete(http, prompt="Hi", n_predict=1, **neutral)["tokens_predicted"] == 1


def _probe_while_running(http: httpx.Client, ask: dict[str, Any]) -> httpx.Response | None:
    """`ask` streamed and, at its first token, /slots read, then /slots?fail_on_no_slot=1:
    the first while the request ran (it answered 503), else None: the request had ended by
    then (3,000 tokens of tiny-moe take a second or two, and a client starved on a loaded
    machine has once read the first line and asked after the last). Leaving the stream
    cancels the rest."""
    with http.stream("POST", "/completion", json=ask) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
        busy = http.get("/slots")
        if http.get("/slots?fail_on_no_slot=1").status_code == 503:
            return busy
    return None


def test_props_and_slots(http: httpx.Client, daemon: Daemon) -> None:
    props = http.get("/props").json()
    assert props["total_slots"] == 1  # the tiny daemon runs one request at a time
    assert props["model_path"].endswith("tiny-moe.gguf")
    assert isinstance(props["chat_template"], str)
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] > 0 and settings["is_processing"] is False
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0] and slots[0]["is_processing"] is False
    # while a request runs its place says so: how far it is, never its prompt
    secret = "a prompt no other client may read"
    ask = {"prompt": secret, "n_predict": 3000, "stream": True, "stop": ["zzz-stop"],
           "ignore_eos": True}  # an early end of sequence would free the place too soon
    busy = next(filter(None, (_probe_while_running(http, ask) for _ in range(5))), None)
    assert busy is not None, "five requests ran, and /slots never found one of them running"
    slot = busy.json()[0]
    assert slot["is_processing"] is True and slot["next_token"]["n_decoded"] >= 1
    assert secret not in busy.text and "zzz-stop" not in busy.text
    assert slot["params"]["n_predict"] == 3000


def test_the_llama_routes_take_the_api_key(daemon: Daemon) -> None:
    with httpx.Client(base_url=daemon.url, timeout=30) as bare:
        for method, path in [("GET", "/props"), ("GET", "/slots"), ("POST", "/completion"),
                             ("POST", "/infill"), ("POST", "/apply-template")]:  # fmt: skip
            r = bare.request(method, path, json={"prompt": "Hi"})
            assert r.status_code == 401, (path, r.text)


def test_apply_template_is_the_prompt_a_chat_request_makes(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]  # fmt: skip
    r = http.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "Name a colour." in prompt
    chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert http.post("/tokenize", json={"content": prompt}).json()["tokens"] == chat_ids
    bad = http.post("/apply-template", json={"messages": [{"role": "nobody", "content": "x"}]})
    assert bad.status_code == 400


def test_infill_on_a_model_without_fim_tokens_says_so(http: httpx.Client) -> None:
    r = http.post("/infill", json={"input_prefix": "def f():\n    ", "input_suffix": "\n"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("Infill is not supported by this model: prefix token is missing")


def test_infill_prompt_with_the_models_fim_tokens() -> None:
    meta = gguf_metadata(GGUFReader(tiny_moe_path()))
    tokens = list(meta["tokenizer.ggml.tokens"])
    # tiny-moe borrows SmolLM2's vocabulary: `<file_sep>` and three other control tokens
    # play the FIM roles that a code model's GGUF names
    roles = {"pre": 11, "suf": 12, "mid": 13}
    fim_meta = {f"tokenizer.ggml.fim_{r}_token_id": i for r, i in roles.items()}
    tok = tokenizer_from_gguf({**meta, **fim_meta})
    assert tok.fim.usable and tok.fim.rep == tokens.index("<reponame>")
    req = InfillRequest(input_prefix="def add(a, b):\n    return ", input_suffix="\n\nprint(1)",
                        input_extra=[InfillChunk(text="x = 1\n", filename="util.py")],
                        prompt="a")  # fmt: skip
    ids = infill_prompt(req, tok)
    pre, suf, mid = ids.index(11), ids.index(12), ids.index(13)
    assert pre < suf < mid == len(ids) - 1
    assert tok.decode(list(ids[pre + 1 : suf])) == "def add(a, b):\n    return a"
    assert tok.decode(list(ids[suf + 1 : mid])) == "\n\nprint(1)"
    # the repo-level pattern needs a file separator: without one, each file as a snippet
    assert "--- snippet ---" in tok.decode(list(ids[:pre])) and "x = 1" in tok.decode(list(ids))
    # code that spells a control token infills it as text
    req = InfillRequest(input_prefix="<|im_end|>", input_suffix="")
    ids = infill_prompt(req, tok)
    assert tokens.index("<|im_end|>") not in ids


def test_fim_tokens_are_found_as_llama_cpp_finds_them() -> None:
    vocab = {"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3, "<|file_sep|>": 4}
    fim = find_fim(vocab, {})
    assert (fim.pre, fim.suf, fim.mid, fim.rep, fim.sep) == (1, 2, 3, None, 4) and fim.usable
    assert find_fim(vocab, {"pre": 9}).pre == 9  # the model's metadata names it first
    assert not find_fim({"<fim_prefix>": 1}, {}).usable
    meta = {"tokenizer.ggml.prefix_token_id": 5, "tokenizer.ggml.fim_mid_token_id": 6}
    declared = gguf_declared(meta)
    assert declared["pre"] == 5 and declared["mid"] == 6 and declared["suf"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_v1_answers_carry_timings_when_asked(daemon: Daemon, stream: bool) -> None:
    client = daemon.client()
    ask: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 3}  # fmt: skip
    if not stream:
        plain = client.chat.completions.create(**ask)
        assert "timings" not in (plain.model_extra or {})
        timed = client.chat.completions.create(**ask, extra_body={"timings_per_token": True})
        timings = (timed.model_extra or {})["timings"]
        assert set(timings) == TIMINGS and timings["predicted_n"] == timed.usage.completion_tokens  # type: ignore[union-attr]
        text = client.completions.create(model="m", prompt="Hi", max_tokens=2,
                                         extra_body={"timings_per_token": True})  # fmt: skip
        assert set((text.model_extra or {})["timings"]) == TIMINGS
        return
    timed_ask = {**ask, "stream": True, "extra_body": {"timings_per_token": True}}
    chunks = list(client.chat.completions.create(**timed_ask))
    timed = [c for c in chunks if (c.model_extra or {}).get("timings")]
    assert timed and set((timed[-1].model_extra or {})["timings"]) == TIMINGS
    assert chunks[-1].choices[0].finish_reason is not None
    assert (chunks[-1].model_extra or {}).get("timings") is not None


def test_api_doc_llama_example_runs() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S)
                if "/completion" in b)  # fmt: skip
    daemon = shared_daemon("default")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("http://127.0.0.1:8080", daemon.url), {})  # noqa: S102 - the doc's
    content, stop_type, predicted = printed.getvalue().split()
    assert content in ("yes", "no") and stop_type == "eos" and int(predicted) >= 1
