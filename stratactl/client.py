"""The control-socket client, and what every socket verb shares (finding the socket, --json).

No torch, no model code: a socket verb starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path
from typing import TypeVar

import msgspec

from stratad.protocol import (
    MAX_REPLY_BYTES,
    ErrorReply,
    ProtocolError,
    Reply,
    Request,
    decode_reply,
    encode,
)

DEFAULT_TIMEOUT_S = 10.0

R = TypeVar("R")


class ClientError(RuntimeError):
    """Cannot talk to the daemon; the message says why and what to do."""


class DaemonError(RuntimeError):
    """The daemon answered with an `ErrorReply`."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.error)
        self.code = reply.code


def add_socket_args(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--socket", type=Path, help="control socket (default: $STRATA_CONTROL_SOCKET,"
                   " else control.socket of the config, else /run/strata/stratad.sock)")
    p.add_argument("--config", type=Path, help="the daemon's config file, to find its socket")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print the reply as JSON")


def socket_path(args: argparse.Namespace) -> Path:
    if getattr(args, "socket", None):
        return Path(args.socket)
    from stratad.config import Config, ConfigError, load_config
    from stratad.env import Env

    try:
        config = load_config(getattr(args, "config", None), Env.read())
    except (ConfigError, ValueError):
        config = Config()  # an unreadable config (e.g. not our group's) still has the default
    return Path(config.control.socket)


class Client:
    def __init__(self, path: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s

    def request(self, request: Request, expect: type[R]) -> R:
        """Send one request; return its reply, raise DaemonError for an error reply."""
        reply = self.exchange(encode(request))
        if isinstance(reply, ErrorReply):
            raise DaemonError(reply)
        if not isinstance(reply, expect):
            raise ClientError(f"the daemon answered {type(reply).__name__} to {request!r}")
        return reply

    def exchange(self, line: bytes) -> Reply:
        """Send raw bytes (one request line) and read one reply line."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.path))
            except FileNotFoundError:
                raise ClientError(
                    f"no control socket at {self.path}: is stratad running?"
                    " (systemctl status stratad; or pass --socket)"
                ) from None
            except PermissionError:
                raise ClientError(
                    f"permission denied on {self.path}: run as root, as the daemon's user, or"
                    " as a member of the socket's group (ls -l shows it; usermod -aG GROUP USER)"
                ) from None
            except ConnectionRefusedError:
                raise ClientError(f"{self.path}: nobody listens (a stale socket?)") from None
            except OSError as e:
                raise ClientError(f"{self.path}: {e.strerror or e}") from None
            try:
                try:
                    sock.sendall(line)
                except OSError as e:
                    # The daemon may answer and hang up before reading it all (a refusal, a
                    # request too large): its reply is still there to read.
                    if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                        raise
                data = _read_line(sock)
            except TimeoutError:
                raise ClientError(f"no answer from the daemon in {self.timeout_s:g} s") from None
            except OSError as e:
                raise ClientError(f"{self.path}: {e.strerror or e}") from None
        if not data:
            raise ClientError("the daemon closed the connection without answering")
        try:
            return decode_reply(data)
        except ProtocolError as e:
            raise ClientError(str(e)) from None


def _read_line(sock: socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk:
            return b"".join(chunks).split(b"\n", 1)[0]
        if size > MAX_REPLY_BYTES:
            raise ClientError(f"reply longer than {MAX_REPLY_BYTES} bytes")


def print_json(message: object) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(message), indent=2).decode() + "\n")


def fail(message: str) -> int:
    print(f"stratactl: {message}", file=sys.stderr)
    return 1


def gib(n: int | float | None) -> str:
    """Bytes for people: GiB, or MiB below one GiB."""
    if n is None:
        return "-"
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def duration(s: float | None) -> str:
    if s is None or s != s or s == float("inf"):
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
