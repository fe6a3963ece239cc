"""Test helper: run a real stratad process on a free port and wait until it serves."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_daemon(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 180.0
) -> Iterator[str]:
    """Start `stratad ARGS --port N`; yield its base URL once /health answers 200.

    Unless ARGS name one, the control socket is `stratad.sock` beside the log (never the
    system's /run/strata, which another test run may be using).
    """
    port = free_port()
    if not any(a.startswith("--control-socket") for a in args):
        args = [*args, "--control-socket", str(log_path.parent / "stratad.sock")]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stratad", *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"stratad exited {proc.returncode}: {log_path.read_text()}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stratad not ready: {log_path.read_text()}")
                time.sleep(0.3)
            yield url
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL if the daemon has not exited within 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def greedy_completions(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion, all requested at once (one client thread each)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def ask(prompt: str) -> str:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0)  # fmt: skip
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))
