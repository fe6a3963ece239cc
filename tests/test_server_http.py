"""The HTTP server in-process over real sockets, with an engine whose prefill is slow on
purpose: SSE keep-alive comments before the first token, CORS (off by default, then on for
the configured origins only), and the embeddings route turned off. The engine is the one part
faked: tiny-moe prefills too fast to show a keep-alive, and neither CORS nor a route turned off
depends on it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from aiohttp import web

from stratad.config import ServerConfig
from stratad.runtime.jobs import Delta, Job, PreparedJob
from stratad.server.app import Server

PREFILL_S = 0.6
KEEPALIVE_S = 0.1
ORIGIN = "https://app.example"


class SlowPrefill:
    """An engine that thinks for PREFILL_S before a job's first token, then says 'a b c'
    (steps of 10 ms). The first job asking for FAIL_ONCE tokens fails at its first token."""

    model_id = "slow"
    max_context = 4096
    parallel = 1
    WORDS = ("a", " b", " c")
    FAIL_ONCE = 13

    def __init__(self) -> None:
        self.jobs: dict[object, list[float]] = {}  # handle -> [first token at, tokens given]
        self.marked: dict[object, str] = {}  # FAIL_ONCE jobs: "fails" (the first), "runs"
        self.aborted: list[str] = []  # what each marked job that was aborted would have done
        self.failed = False  # whether the FAIL_ONCE job came

    def prepare(self, job: Job) -> PreparedJob:
        return PreparedJob(job=job, prompt=(1, 2, 3), max_tokens=job.max_tokens or 3)

    def add(self, job: PreparedJob) -> object:
        handle = object()
        self.jobs[handle] = [time.monotonic() + PREFILL_S, 0]
        if job.job.max_tokens == self.FAIL_ONCE:
            self.marked[handle] = "runs" if self.failed else "fails"
            self.failed = True
        return handle

    def step(self) -> list[tuple[object, Delta | Exception]]:
        time.sleep(0.01)
        out: list[tuple[object, Delta | Exception]] = []
        for handle, job in list(self.jobs.items()):
            if time.monotonic() < job[0]:
                continue
            if self.marked.get(handle) == "fails":
                out.append((handle, RuntimeError("this choice fails")))
                del self.jobs[handle], self.marked[handle]
                continue
            job[1] += 1
            n = int(job[1])
            last = n == len(self.WORDS)
            out.append((handle, Delta(text=self.WORDS[n - 1], prompt_tokens=3,
                                      finish_reason="length" if last else None,
                                      completion_tokens=n)))  # fmt: skip
            if last:
                del self.jobs[handle]
        return out

    def abort(self, handle: object) -> None:
        self.jobs.pop(handle, None)
        if handle in self.marked:
            self.aborted.append(self.marked.pop(handle))


@contextlib.contextmanager
def serving(config: ServerConfig, engine: SlowPrefill | None = None) -> Iterator[str]:
    """The app of `config` on a free port, its loop on a thread; yields the base URL."""
    server = Server(config)
    server.attach(engine or SlowPrefill())
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app)
    ready = threading.Event()
    port: list[int] = []

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    with serving(ServerConfig(sse_keepalive_s=KEEPALIVE_S, api_key="k", embeddings="off")) as url:
        yield url


@pytest.fixture(scope="module")
def cors() -> Iterator[str]:
    with serving(ServerConfig(allowed_origins=(ORIGIN,), api_key="k")) as url:
        yield url


async def _raw_stream(url: str) -> list[tuple[float, bytes]]:
    """The SSE body of a streamed text completion, line by line with the time it came."""
    body = {"model": "slow", "prompt": "hi", "stream": True}
    lines = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k"}) as r,
    ):
        assert r.status == 200
        t0 = time.monotonic()
        async for line in r.content:
            lines.append((time.monotonic() - t0, line))
    return lines


def test_keepalive_comments_during_a_long_prefill(plain: str) -> None:
    lines = asyncio.run(_raw_stream(plain))
    first = next(i for i, (_, line) in enumerate(lines) if line.startswith(b"data: "))
    comments = [t for t, line in lines[:first] if line == b": keep-alive\n"]
    # one a KEEPALIVE_S while the engine prefilled for PREFILL_S, none after the first token
    assert len(comments) >= PREFILL_S / KEEPALIVE_S / 2, lines
    assert all(b"keep-alive" not in line for _, line in lines[first:])
    assert comments[0] < PREFILL_S / 2
    assert lines[-2][1] == b"data: [DONE]\n"


def test_openai_client_reads_past_the_comments(plain: str) -> None:
    client = openai.OpenAI(base_url=f"{plain}/v1", api_key="k", max_retries=0)
    chunks = list(client.completions.create(model="slow", prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "a b c"


async def _preflight(
    url: str, path: str, origin: str, asked: str = "authorization, content-type"
) -> tuple[int, dict[str, str]]:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked,
    }
    async with aiohttp.ClientSession() as s, s.options(url + path, headers=headers) as r:
        return r.status, dict(r.headers)


async def _get(url: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
        return r.status, dict(r.headers)


def test_a_failed_choice_stops_its_siblings() -> None:
    """n = 2, the first choice fails: the answer is the 500 at once, and the other choice
    does not run on for nothing (it did before). With one job on the engine at a time the
    sibling waits behind the failing one, so it is either taken off the engine (admitted
    before the cancel came) or never given to it (the cancel came first): either way it
    gives no token, and none later."""
    engine = SlowPrefill()
    with serving(ServerConfig(api_key="k"), engine) as url:
        body = {"model": "slow", "prompt": "hi", "n": 2, "max_tokens": SlowPrefill.FAIL_ONCE}
        status, _ = asyncio.run(_post(url, "/v1/completions", body))
        assert status == 500
        deadline = time.monotonic() + 3 * PREFILL_S  # long enough for it to finish if it ran
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    assert engine.aborted in ([], ["runs"])
    assert "runs" not in engine.marked.values()  # never given to the engine, or taken off it


async def _post(url: str, path: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k"}) as r,
    ):
        return r.status, await r.read()


def test_embeddings_turned_off_answer_501(plain: str) -> None:
    client = openai.OpenAI(base_url=f"{plain}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model="slow", input="hi")
    assert info.value.status_code == 501, info.value
    assert "server.embeddings" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "not_supported_error"


def test_cors_is_off_by_default(plain: str) -> None:
    status, headers = asyncio.run(_preflight(plain, "/v1/chat/completions", ORIGIN))
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    auth = {"Authorization": "Bearer k", "Origin": ORIGIN}
    status, headers = asyncio.run(_get(plain, "/v1/models", auth))
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_cors_answers_the_configured_origin_only(cors: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        status, headers = asyncio.run(_preflight(cors, path, ORIGIN))
        assert status == 200, (path, headers)  # no key needed: a preflight carries none
        assert headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in headers["Access-Control-Allow-Methods"]
        allowed = headers["Access-Control-Allow-Headers"].lower()
        assert "authorization" in allowed and "content-type" in allowed
    status, headers = asyncio.run(_preflight(cors, "/v1/chat/completions", "https://evil.example"))
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    status, headers = asyncio.run(_get(cors, "/v1/models", {"Authorization": "Bearer k",
                                                           "Origin": ORIGIN}))  # fmt: skip
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    status, headers = asyncio.run(_get(cors, "/v1/models", {"Origin": ORIGIN}))
    assert status == 401  # the key still guards the API itself


def test_cors_lets_anthropics_browser_sdk_send_its_headers(cors: str) -> None:
    asked = ("x-api-key, anthropic-version, anthropic-dangerous-direct-browser-access,"
             " content-type")  # fmt: skip
    status, headers = asyncio.run(_preflight(cors, "/v1/messages", ORIGIN, asked))
    assert status == 200, headers
    allowed = headers["Access-Control-Allow-Headers"].lower()
    assert all(h.strip() in allowed for h in asked.split(","))
