"""The control socket: newline-delimited `stratad.protocol` messages on a Unix stream socket.

It runs its own asyncio loop on its own thread, so it answers while the model loads and pins,
and whatever the HTTP side is doing. Access: the socket file's mode and group, then the peer's
credentials (SO_PEERCRED): root, the daemon's own user, or a member of the socket's group.
A malformed, unknown or oversized message gets an `ErrorReply`; nothing a client sends can stop
the daemon, nor lock others out: a connection closes after `control.idle_timeout_s` without a
request; one uid holds at most `control.max_clients_per_peer` connections (a new one closes
that uid's longest-idle one; if none is idle it waits up to `ADMIT_WAIT_S` for one to become
idle or close, so that clients which just hung up never lock their uid out, and is refused
after that); a `drain` that waits does so on
the loop, never holding one of the few worker threads. A failing verb is
answered in our words; the exception goes to the daemon's log.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import grp
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from stratad.control.provider import Provider, Unavailable
from stratad.protocol import (
    MAX_REQUEST_BYTES,
    CoverageRequest,
    DrainRequest,
    ErrorCode,
    ErrorReply,
    PlanRequest,
    ProfileSaveRequest,
    ProtocolError,
    Request,
    StatsRequest,
    StatusRequest,
    UndrainRequest,
    decode_request,
    encode,
)
from stratad.server.http.listener import quiet_accept_errors

log = logging.getLogger("stratad.control")

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
MAX_DRAIN_WAIT_S = 3600.0
ADMIT_WAIT_S = 1.0  # a connection over its uid's limit waits this long for a slot
DRAIN_POLL_S = 0.1


class ControlError(RuntimeError):
    """The socket cannot be set up (path in use by a live daemon, no permission, bad group)."""


class SocketHeld(ControlError):
    """Another live daemon listens on the socket's path: a second one must not start beside
    it (stratactl would reach the first, and the second could never be reached)."""


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    groups: set[int] = set()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 256)
        groups.update(struct.unpack(f"{len(raw) // 4}I", raw))
    except OSError:  # old kernel: the peer's supplementary groups from /proc
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    return Peer(pid, uid, gid, frozenset(groups))


def listener(path: Path, timeout_s: float = 1.0) -> Peer | None:
    """The process listening on the Unix socket at `path` (who accepted a connection to it),
    or None when nothing does: no socket there, or a stale file whose daemon died."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout_s)
        try:
            probe.connect(str(path))
        except OSError:
            return None
        return peer_of(probe)


@dataclass(frozen=True)
class Access:
    """Who may talk to the daemon: root, the daemon's user, members of `gid`."""

    uid: int
    gid: int

    def refusal(self, peer: Peer) -> str | None:
        if peer.uid in (0, self.uid) or peer.gid == self.gid or self.gid in peer.groups:
            return None
        return (
            f"uid {peer.uid} (pid {peer.pid}) is not root, the daemon's user (uid {self.uid})"
            f" or a member of group {_group_name(self.gid)}"
        )


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name!r} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def resolve_group(name: str) -> int:
    """The socket's group: empty is the daemon's own group; a name or a number otherwise."""
    if not name:
        return os.getgid()
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ControlError(f"control.group={name!r}: no such group") from None


def parse_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise ControlError(f"control.mode={text!r}: expected an octal mode like 0660") from None
    if not 0 <= mode <= 0o777:
        raise ControlError(f"control.mode={text!r}: expected an octal file mode like 0660")
    return mode


class ControlServer:
    def __init__(
        self,
        path: Path,
        provider: Provider,
        *,
        mode: int = 0o660,
        gid: int | None = None,
        max_clients: int = 64,
        max_clients_per_peer: int = 8,
        idle_timeout_s: float = 10.0,
    ) -> None:
        self.path = path
        self.provider = provider
        self.mode = mode
        self.access = Access(os.getuid(), os.getgid() if gid is None else gid)
        self.max_clients = max_clients
        self.max_clients_per_peer = max_clients_per_peer
        self.idle_timeout_s = idle_timeout_s
        self._refusals = _Refusals()  # one WARNING per peer every few seconds
        self.clients = 0
        self._per_uid: collections.Counter[int] = collections.Counter()
        # per uid, its connections waiting for a request, longest-waiting first
        # each uid's connections waiting for a request, oldest first; the value says whether
        # the connection has been answered before (see _evict)
        self._idle: dict[int, dict[asyncio.StreamWriter, bool]] = collections.defaultdict(dict)
        self._slot_freed: asyncio.Condition | None = None  # made on the loop's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._inode = 0
        # Provider calls may block (drain waits, profile-save writes): never on the loop.
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="control")

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Bind (errors raise here, in the caller's thread), then serve on a thread."""
        self._sock = self._bind()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="control-socket", daemon=True
        )
        self._thread.start()
        ready.wait()
        log.info(
            "control socket on %s (mode %o, group %s)",
            self.path,
            self.mode,
            _group_name(self.access.gid),
        )

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
        self._workers.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:  # still ours, not a successor's
                os.unlink(self.path)

    def _bind(self) -> socket.socket:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ControlError(f"{self.path.parent}: cannot create: {e.strerror}") from None
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise ControlError(f"{self.path} exists and is not a socket; not replacing it")
            holder = listener(self.path)
            if holder is not None:
                raise SocketHeld(f"{self.path}: another stratad is listening there (pid"
                                 f" {holder.pid}); stop it first, or give this one another"
                                 " control.socket")  # fmt: skip
            os.unlink(self.path)  # a stale socket from a daemon that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Until the chmod below the umask's mode applies, which never grants others write
            # (connect) permission with the usual umasks; the peer check stands behind it anyway.
            sock.bind(str(self.path))
            if self.access.gid != os.getgid():
                os.chown(self.path, -1, self.access.gid)
            os.chmod(self.path, self.mode)
            sock.listen(64)
        except OSError as e:
            sock.close()
            raise ControlError(f"{self.path}: cannot set up the control socket: {e}") from None
        self._inode = os.stat(self.path).st_ino
        return sock

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        quiet_accept_errors(loop, log)
        self._slot_freed = asyncio.Condition()
        server = loop.run_until_complete(
            asyncio.start_unix_server(self._client, sock=self._sock, limit=MAX_REQUEST_BYTES)
        )
        ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    # ---- one connection -----------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.clients += 1
        try:
            await self._converse(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug here must not take the socket down with it
            log.exception("control socket: unexpected error")
        finally:
            self.clients -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_of(writer.get_extra_info("socket"))
        refusal = self.access.refusal(peer)
        if refusal is not None:
            self._refusals.warn(peer.uid, refusal)
            reply = ErrorReply(code="permission", error=f"permission denied: {refusal}")
            await _send(writer, reply)
            return
        if self.clients > self.max_clients:
            await _send(writer, ErrorReply(code="busy", error="too many control connections"))
            return
        if not await self._admit(peer.uid):
            await _send(writer, ErrorReply(
                code="busy", error=f"uid {peer.uid} holds {self.max_clients_per_peer} control"
                " connections already (control.max_clients_per_peer)",
            ))  # fmt: skip
            return
        self._per_uid[peer.uid] += 1
        try:
            await self._requests(reader, writer, peer)
        finally:
            self._per_uid[peer.uid] -= 1
            if not self._per_uid[peer.uid]:
                del self._per_uid[peer.uid], self._idle[peer.uid]
            await self._free_slot()

    async def _admit(self, uid: int) -> bool:
        """Whether a new connection of `uid` may stay: under the limit, or room made by
        closing an idle one, within `ADMIT_WAIT_S` (a hung-up client's connection counts
        until its answer is written and its end of file read)."""
        assert self._slot_freed is not None
        deadline = time.monotonic() + ADMIT_WAIT_S
        async with self._slot_freed:
            while self._per_uid[uid] >= self.max_clients_per_peer and not self._evict(uid):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), left)
        return True

    async def _free_slot(self) -> None:
        """A connection closed or went idle: wake connections waiting in `_admit`."""
        if self._slot_freed is not None:
            async with self._slot_freed:
                self._slot_freed.notify_all()

    def _evict(self, uid: int) -> bool:
        """Close `uid`'s longest-idle connection to make room; false if none is idle. One
        that has been answered goes first: a client that asks again on a new connection
        leaves its old one counted until its end of file is read, and under load a new
        connection whose request is not read yet would otherwise be the longest idle."""
        idle = self._idle[uid]
        if not idle:
            return False
        oldest = next((w for w, answered in idle.items() if answered), next(iter(idle)))
        del idle[oldest]
        oldest.close()
        return True

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer
    ) -> None:
        answered = False
        while True:
            idle = self._idle[peer.uid]
            idle[writer] = answered
            await self._free_slot()  # evictable now
            try:
                line = await asyncio.wait_for(reader.readline(), self.idle_timeout_s)
            except (ValueError, asyncio.LimitOverrunError):
                await _send(
                    writer,
                    ErrorReply(
                        code="too-large", error=f"request longer than {MAX_REQUEST_BYTES} bytes"
                    ),
                )
                return  # the rest of that line is still on its way: no way to resynchronise
            except TimeoutError:
                return
            finally:
                idle.pop(writer, None)
            if not line or writer.is_closing():
                return
            if line.strip():
                await _send(writer, await self._answer(line, peer))
                answered = True

    async def _answer(self, line: bytes, peer: Peer) -> object:
        try:
            request = decode_request(line)
        except ProtocolError as e:
            return ErrorReply(code=e.code, error=str(e))
        if isinstance(request, (DrainRequest, UndrainRequest, ProfileSaveRequest)):
            log.info(
                "control socket: %s from uid %d (pid %d)",
                type(request).__struct_config__.tag,
                peer.uid,
                peer.pid,
            )
        verb = str(type(request).__struct_config__.tag)
        code: ErrorCode
        try:
            if isinstance(request, DrainRequest):
                return await self._drain(min(max(request.wait_s, 0.0), MAX_DRAIN_WAIT_S))
            return await self._call(self._dispatch, request)
        except Unavailable as e:
            code, message = "unavailable", str(e)
        except OSError as e:  # e.g. profile-save on a full disk: the peer may act on it
            log.warning("control socket: %s failed: %s", verb, e)
            code, message = "unavailable", f"{verb} failed: {e.strerror or 'system error'}"
        except Exception:
            log.exception("control socket: %s failed", verb)
            code, message = "internal", f"{verb} failed inside the daemon; its log has the details"
        return ErrorReply(code=code, error=message)

    async def _call(self, fn: Callable[..., object], *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def _drain(self, wait_s: float) -> object:
        """Begin the drain, then poll it from the loop: a long wait holds no worker thread."""
        deadline = time.monotonic() + wait_s
        while True:
            reply = await self._call(self.provider.drain, 0.0)
            if getattr(reply, "drained", True) or time.monotonic() >= deadline:
                return reply
            await asyncio.sleep(min(DRAIN_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _dispatch(self, request: Request) -> object:
        p = self.provider
        if isinstance(request, StatusRequest):
            return p.status()
        if isinstance(request, CoverageRequest):
            return p.coverage()
        if isinstance(request, PlanRequest):
            return p.plan()
        if isinstance(request, StatsRequest):
            return p.stats()
        if isinstance(request, ProfileSaveRequest):
            return p.save_profile(request.path)
        if isinstance(request, UndrainRequest):
            return p.undrain()
        raise AssertionError(f"no handler for {request!r}")


async def _send(writer: asyncio.StreamWriter, reply: object) -> None:
    writer.write(encode(reply))  # type: ignore[arg-type]
    await writer.drain()


REFUSAL_LOG_EVERY_S = 10.0


class _Refusals:
    """Refused connects logged as one WARNING per peer uid every REFUSAL_LOG_EVERY_S seconds,
    the next line counting those held back (a burst of 2,001 refused connects logged 2,001
    lines)."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}
        self._held: collections.Counter[int] = collections.Counter()

    def warn(self, uid: int, refusal: str) -> None:
        now = time.monotonic()
        last = self._last.get(uid)
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            self._held[uid] += 1
            return
        self._last[uid] = now
        held = self._held.pop(uid, 0)
        more = f" ({held} more since the last line)" if held else ""
        log.warning("control socket: refused %s%s", refusal, more)
