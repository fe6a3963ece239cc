"""The first examples a new user runs, as the README and docs/api.md write them, against the
daemon on the default model: each answers in seconds with a short reply."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import time
from pathlib import Path

from tests.server_helpers import request, shared_daemon

REPO = Path(__file__).resolve().parents[1]
DOC_URL = "http://127.0.0.1:8080"


def _first_block(path: Path, lang: str, containing: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)
    return next(b for b in blocks if containing in b)


def test_readme_first_curl_finishes_in_seconds() -> None:
    words = shlex.split(_first_block(REPO / "README.md", "sh", "curl").replace("\\\n", " "))
    assert words[:3] == ["curl", "-s", f"{DOC_URL}/v1/chat/completions"], words
    body = json.loads(words[words.index("-d") + 1])
    # `default_max_tokens = 0` lets a chat reply run to the end of the context: minutes of
    # repeated text while `curl -s` shows nothing
    assert 0 < body.get("max_tokens", 0) <= 64, body
    daemon = shared_daemon("default")
    t0 = time.monotonic()
    status, raw = request(words[2].replace(DOC_URL, daemon.url), json.dumps(body).encode(),
                          timeout=60)  # fmt: skip
    elapsed = time.monotonic() - t0
    reply = json.loads(raw)
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"], reply
    assert reply["usage"]["completion_tokens"] <= body["max_tokens"], reply
    assert elapsed < 30, elapsed


def test_api_doc_first_example_runs() -> None:
    code = _first_block(REPO / "docs" / "api.md", "python", "openai.OpenAI")
    daemon = shared_daemon("default")
    assert f'"{DOC_URL}/v1"' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace(DOC_URL, daemon.url), {})  # noqa: S102 - the doc's own example
    assert printed.getvalue().strip()
