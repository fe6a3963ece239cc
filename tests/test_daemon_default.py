"""The daemon on the default model, driven with the real `openai` client over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.daemon import running_daemon
from tests.engine_answer import greedy_chat


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("daemon") / "stratad.log"
    with running_daemon([], log) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_chat_completion_answers(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    # what the engine a CPU host serves it with computes (the cpu engine, which rounds
    # activations as llama.cpp does: "L'Étoile, la Marseillaise, ..."; the float reference
    # says "The capital of France is Paris.")
    text, finish = greedy_chat([{"role": "user", "content": "What is the capital of France?"}], 32)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, finish)
    assert r.usage is not None and r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 5


def test_models_lists_default(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_bad_request_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    assert "temperature" in str(info.value)


def test_log_has_no_errors(tmp_path_factory: pytest.TempPathFactory) -> None:
    # the module's daemon log lives in the first "daemon" temp dir
    logs = list(Path(tmp_path_factory.getbasetemp()).glob("daemon*/stratad.log"))
    assert logs and all("ERROR" not in p.read_text() for p in logs)
