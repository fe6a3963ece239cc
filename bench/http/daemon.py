"""A `stratad` for a benchmark: started on a free loopback port with a config of the
benchmark's, its base URL once /health says 200, stopped on the way out."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _show_log(path: Path, lines: int = 40) -> None:
    """The log's last lines on stderr (the work folder of a benchmark is often temporary)."""
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    print("\n".join(["-- the end of stratad's log:", *tail]), file=sys.stderr, flush=True)


@contextlib.contextmanager
def daemon(model: str | None, work: Path, config: str, timeout: float = 300.0) -> Iterator[str]:
    """`stratad [MODEL] --config work/stratad.toml` (holding `config`), its log in
    work/stratad.log; its base URL once it serves."""
    path = work / "stratad.toml"
    path.write_text(config)
    port = _free_port()
    cmd = [sys.executable, "-m", "stratad", *([model] if model else []), "--config",
           str(path), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with open(work / "stratad.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                _show_log(work / "stratad.log")
                raise RuntimeError(f"stratad exited {proc.returncode}; see {work / 'stratad.log'}")
            if _healthy(url):
                break
            if time.monotonic() > deadline:
                _show_log(work / "stratad.log")
                raise TimeoutError(
                    f"stratad not ready in {timeout:.0f} s; see {work / 'stratad.log'}"
                )
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
