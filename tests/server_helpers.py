"""Helpers of the server tests: the tiny-moe model, daemons shared by several test modules.

A daemon started here lives until the test process ends (atexit), so the API, cancellation,
load and fuzz modules share one tiny-moe daemon instead of paying for a start each.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon import running_daemon

API_KEY = "test-key"
_WORK = Path(tempfile.mkdtemp(prefix="strata-server-tests-"))
_STACK = contextlib.ExitStack()
atexit.register(_STACK.close)

# One torch thread: on a shared 2-core machine, OpenMP's barriers stall when another process
# holds a core, and a step then costs scheduler quanta instead of microseconds.
CONFIGS = {
    # the API, cancellation and load tests: a key, a short queue, a small body limit
    "tiny": f"""
[model]
aliases = ["m"]
[server]
api_key = "{API_KEY}"
max_queue = 8
# one request at a time: the queue and cancellation tests line requests up behind another
parallel = 1
max_body_bytes = 1048576
allowed_hosts = ["strata.test"]
[control]
socket = ""
[engine]
threads = 1
""",
    # several requests at once (tests/test_parallel.py), a KV pool of one 512-token context
    # for all three: long answers together preempt the newest
    "parallel": """
[model]
aliases = ["m"]
max_context = 512
[server]
parallel = 3
kv_cache_tokens = 512
[control]
socket = ""
[engine]
threads = 1
""",
    # the fuzz test: a short context and short default completions keep each example fast
    "fuzz": """
[model]
max_context = 256
aliases = ["*"]
[server]
max_queue = 4
default_max_tokens = 8
[control]
socket = ""
[engine]
threads = 1
""",
    # the connection limits and timeouts, short enough to be seen in a test
    "limits": """
[model]
aliases = ["m"]
[server]
idle_timeout_s = 1.0
body_timeout_s = 1.0
max_connections = 6
send_buffer_bytes = 16384
send_timeout_s = 1.0
[control]
socket = ""
[engine]
threads = 1
""",
    "default": """
[control]
socket = ""
[engine]
threads = 1
""",
}


@functools.cache
def tiny_moe_path() -> Path:
    """tiny-moe written once per test process, the way an operator would (`stratactl synth`)."""
    path = _WORK / "tiny-moe.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "stratactl", "synth", "tiny-moe", "-o", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 or not path.is_file():  # the CLI is young: fall back to the writer
        from stratad.model.synthetic.writer import PRESETS, write_synth

        write_synth(PRESETS["tiny-moe"], path, overwrite=True)
    return path


@dataclass(frozen=True)
class Daemon:
    url: str
    log: Path
    api_key: str | None

    @property
    def control_socket(self) -> Path:
        """Its control socket: tests/daemon.py puts one beside the log."""
        return self.log.parent / "stratad.sock"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        return request(self.url + path, headers=headers)

    def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return request(self.url + path, body, {**h, **(headers or {})})

    def health(self) -> dict[str, Any]:
        return dict(json.loads(self.get("/health")[1]))

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, read by prometheus_client's parser: `name{labels}` ->
        value, the `model_name` label left out (one model is served)."""
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1].decode()):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def log_errors(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if " ERROR " in line]


def request(
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
) -> tuple[int, bytes]:
    # a body goes as JSON, as every OpenAI client sends it (urllib's default is a form)
    sent = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(url, data=body, headers=sent | (headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _model_args(name: str) -> list[str]:
    return [] if name == "default" else [str(tiny_moe_path())]


@functools.cache
def shared_daemon(name: str) -> Daemon:
    """The daemon of config `name` (see CONFIGS), started on first use."""
    folder = _WORK / name
    folder.mkdir()
    config = folder / "stratad.toml"
    config.write_text(CONFIGS[name])
    log = folder / "stratad.log"
    url = _STACK.enter_context(running_daemon([*_model_args(name), "--config", str(config)], log))
    return Daemon(url, log, API_KEY if "api_key" in CONFIGS[name] else None)


def wait_until(predicate: Any, timeout: float, interval: float = 0.005) -> float:
    """Poll until `predicate()` is true; return when that was (monotonic) or raise."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval)
