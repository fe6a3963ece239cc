"""Between the HTTP handlers and the engine: a bounded FIFO queue and one engine thread.

The handlers `admit` a request (a full queue refuses at once: `QueueFull`, 429 with
Retry-After; so does a daemon that is loading or draining: `Unavailable`, 503), tokenise and
check it (`Engine.prepare`, off the engine thread and the event loop, so that tokenisation and
I/O overlap the running job), then `submit` it. A request waiting for the tokenizer holds its
place in the queue: a burst of large prompts is refused, not tokenized all at once.

The engine thread is one loop of steps (`_loop`): start queued tickets in arrival order while
the engine has a free place (`parallel` of them), take cancelled ones off it, then
`engine.step()`: one batched forward computes every running job's next tokens (prompt chunks
beside decodes, `stratad/runtime/step_plan.py`), so N clients share each read of the
weights, and each job that sampled gets its delta. A job that ends frees its place for the
next ticket before the next step. With `parallel` 1 a job runs alone, to its end. Deltas
cross to the event loop through the ticket's asyncio queue. A ticket cancelled by its client
(disconnect) is skipped while it waits, and stopped before the next step while it runs. A
job whose own part of a step fails gets its error alone; a step that fails as a whole fails
the jobs it ran, and the loop goes on. What one turn of the loop gives its tickets crosses to
the event loop in one call, not one per ticket: each call is a write to the event loop's
self-pipe that wakes it.

No torch here: the server imports this module.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from stratad.runtime.jobs import Delta, Job, JobError, PreparedJob

log = logging.getLogger("stratad.scheduler")

STOPPING = "stopping"  # the drain reason of a shutdown: no undrain from it

# what the engine thread hands a ticket: a delta, the error that ended it, or None (the end)
Item = Delta | BaseException | None


class Backend(Protocol):
    """What the scheduler and the server need of the engine."""

    @property
    def model_id(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    @property
    def parallel(self) -> int:
        """Jobs the engine runs at once."""
        ...

    def prepare(self, job: Job) -> PreparedJob: ...

    def add(self, job: PreparedJob) -> object:
        """Start a job (a place is free); its handle, which `step` names it by."""
        ...

    def step(self) -> list[tuple[object, Delta | Exception]]:
        """One step of every running job: a delta for each that sampled a token (the last one
        with its finish reason), or the error that ended it; an ended job is off the engine.
        Raises if the step as a whole failed (every running job is then off the engine)."""
        ...

    def abort(self, handle: object) -> None:
        """Take a running job off the engine (its client went away)."""
        ...


class Refused(Exception):
    """A request the scheduler will not take now; the client may retry after `retry_after` s."""

    status = 503

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(Refused):
    status = 429


class Unavailable(Refused):
    status = 503


class EngineFailed(RuntimeError):
    """The engine raised while running a job: a server fault, logged where it happened."""


class Ticket:
    """One submitted job: its deltas, its timings and its cancel flag."""

    def __init__(
        self,
        prepared: PreparedJob,
        loop: asyncio.AbstractEventLoop,
        on_cancel: Callable[[Ticket], None] | None = None,
    ) -> None:
        self.prepared = prepared
        self.loop = loop
        self._on_cancel = on_cancel
        self.deltas: asyncio.Queue[Item] = asyncio.Queue()
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.first_token: float | None = None
        self.finished: float | None = None
        self.last: Delta | None = None  # the final delta (finish reason, usage)
        self.last_at: float | None = None  # when the engine gave its last delta
        self.token_gaps: list[float] = []  # seconds between consecutive tokens
        self.cancelled_at: float | None = None
        # "client" (it went away), "drain" (the daemon is stopping) or "request" (answered
        # without it: another choice of its request failed)
        self.cancelled_by = ""
        self.error: str | None = None

    def cancel(self, by: str = "client") -> None:
        """Ask the engine to stop this job; idempotent, any thread."""
        if self.cancelled_at is None:
            self.cancelled_by = by
            self.cancelled_at = time.monotonic()
            if self._on_cancel is not None:
                self._on_cancel(self)

    def is_cancelled(self) -> bool:
        return self.cancelled_at is not None

    @property
    def outcome(self) -> str:
        if self.error is not None:
            return "error"
        if self.last is not None and self.last.finish_reason:
            return self.last.finish_reason
        return "abort"

    def _push(self, item: Item) -> None:
        _post([(self, item)])

    async def stream(self) -> AsyncIterator[Delta]:
        """The deltas as the engine makes them; raises `JobError`/`EngineFailed` from the run."""
        while True:
            item = await self.deltas.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def _post(items: list[tuple[Ticket, Item]]) -> None:
    """Hand items to their tickets (any thread): one call into each event loop, in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Item]]] = {}
    for ticket, item in items:
        by_loop.setdefault(ticket.loop, []).append((ticket, item))
    for loop, mine in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, mine)
        except RuntimeError:  # the event loop is closed: the daemon is going down
            for ticket, _ in mine:
                ticket.cancel()


def _put_all(items: list[tuple[Ticket, Item]]) -> None:
    for ticket, item in items:
        ticket.deltas.put_nowait(item)


class Scheduler:
    """FIFO service of tickets by one engine thread, up to `parallel` at once."""

    def __init__(
        self,
        max_queue: int,
        on_finished: Callable[[Ticket], None] | None = None,
    ) -> None:
        self.max_queue = max_queue
        self.parallel = 1  # the engine's, once attached
        # what every finished ticket is reported to (the HTTP metrics, the control socket's
        # meter): one account of each request, taken where it ran
        self.listeners: list[Callable[[Ticket], None]] = [on_finished] if on_finished else []
        # loading -> ready <-> draining (back on undrain, unless stopping); or failed. The one
        # owner of "draining": HTTP refuses new requests by it, /health and the control socket
        # report it.
        self.state = "loading"
        self.drain_reason: str | None = None  # why it drains: "stopping", "stratactl drain"
        self.held: str | None = None  # e.g. "pinning": loaded, but not to serve yet
        self.engine: Backend | None = None
        self.running: list[Ticket] = []  # started by the engine thread, not yet finished
        self._preparing = 0  # admitted, not yet submitted: waiting for the tokenizer
        self._queue: collections.deque[Ticket] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._service_s = 2.0  # moving average of a job's engine time, for Retry-After
        self._outbox: list[tuple[Ticket, Item]] = []  # the engine thread's, sent once a turn

    # --- state -------------------------------------------------------------------------------

    def attach(self, engine: Backend) -> None:
        """The model is loaded: start serving (as many jobs at once as the engine runs)."""
        self.engine = engine
        self.parallel = engine.parallel
        if self.state == "loading":  # a drain begun while it loaded stays
            self.state = "ready"
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.held is None

    @property
    def status(self) -> str:
        """What /health reports: the state, or why a loaded daemon is held back."""
        return self.held if self.state == "ready" and self.held else self.state

    @property
    def waiting(self) -> int:
        """Requests waiting for the engine, or before it for the tokenizer."""
        return len(self._queue) + self._preparing

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def in_flight(self) -> int:
        return self.waiting + self.num_running

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead times the mean service time,
        over the jobs served at once."""
        ahead = self.waiting + self.num_running
        return int(min(max(math.ceil(ahead * self._service_s / self.parallel), 1), 600))

    # --- the handlers' side ------------------------------------------------------------------

    def _refuse_unless_ready(self) -> None:
        if not self.ready:
            raise Unavailable(f"the server is {self.status}", 1 if self.state == "loading" else 5)

    def admit(self) -> None:
        """Take a place in the queue for a request about to be tokenized; raises `Refused` if
        the daemon cannot take it now. Follow with `submit`, or `withdraw` to give it back."""
        self._refuse_unless_ready()
        with self._cv:
            if self.in_flight > self.max_queue:
                raise QueueFull(
                    f"the server is busy ({self.waiting} requests waiting); retry later",
                    self.retry_after(),
                )
            self._preparing += 1

    def admit_choice(self) -> None:
        """Take a place for one more choice (`n > 1`) of a request just admitted: never
        refused for a full queue, since the request as a whole was let in (a lone request
        with more choices than `max_queue` must not be turned away)."""
        self._refuse_unless_ready()
        with self._cv:
            self._preparing += 1

    def withdraw(self) -> None:
        """An admitted request will not be submitted (bad input, its client left)."""
        with self._cv:
            self._preparing -= 1
            self._cv.notify_all()  # wait_idle

    def submit(self, prepared: PreparedJob) -> Ticket:
        """Queue an admitted request's job (its place was kept); raises `Unavailable`, the
        place given back, if the daemon stopped taking work meanwhile."""
        try:
            self._refuse_unless_ready()
        except Unavailable:
            self.withdraw()
            raise
        ticket = Ticket(prepared, asyncio.get_running_loop(), self._discard)
        with self._cv:
            self._preparing -= 1
            self._queue.append(ticket)
            self._cv.notify_all()  # the engine thread (and any wait_idle)
        return ticket

    def begin_drain(self, reason: str) -> None:
        """Refuse new work from now on (what is queued or running carries on)."""
        if self.state != "failed" and self.drain_reason != STOPPING:
            self.state, self.drain_reason = "draining", reason

    def undrain(self) -> bool:
        """Take new work again after `begin_drain`; false when stopping (or not drained)."""
        if self.state != "draining" or self.drain_reason == STOPPING:
            return False
        self.state = "ready" if self.engine is not None else "loading"
        self.drain_reason = None
        return True

    def wait_idle(self, timeout: float) -> int:
        """Block (never on the event loop) until nothing is queued or running, or `timeout` s
        have passed; how many requests are still in flight."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.in_flight and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(min(left, 0.1))
            return self.in_flight

    async def drain(self, timeout: float) -> None:
        """Stop: refuse new work, let queued and running jobs finish for `timeout` s, cancel
        the rest."""
        self.begin_drain(STOPPING)
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cancelled = self.cancel_all()
        if cancelled:
            log.warning("drain: cancelled %d unfinished requests after %.0f s", cancelled, timeout)
        while self.in_flight:
            await asyncio.sleep(0.01)

    def cancel_all(self) -> int:
        """Cancel every queued and running request (the daemon stops); how many there were."""
        with self._cv:
            pending = list(self._queue) + list(self.running)
        for t in pending:
            t.cancel(by="drain")
        return len(pending)

    def _discard(self, ticket: Ticket) -> None:
        """A waiting ticket was cancelled: take it out of the queue now (it frees its slot)."""
        with self._cv:
            try:
                self._queue.remove(ticket)
            except ValueError:
                return  # running or done: the engine thread finishes it
        ticket.finished = time.monotonic()
        ticket._push(None)
        self._after(ticket)

    # --- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        """One step after another: admit, drop the cancelled, step, deliver."""
        engine = self.engine
        assert engine is not None
        jobs: dict[object, Ticket] = {}  # the engine's handles of the running tickets
        while True:
            self._send_all()  # the last turn's deltas and ends, before waiting for more work
            for ticket in self._take(len(jobs)):
                try:
                    jobs[engine.add(ticket.prepared)] = ticket
                except Exception as e:  # its own start failed (e.g. its grammar): it alone
                    if not isinstance(e, JobError):
                        log.exception("the engine could not start a request")
                    self._fail(ticket, e)
                    self._end(ticket)
            for handle, ticket in list(jobs.items()):
                if ticket.is_cancelled():
                    engine.abort(handle)
                    self._end(jobs.pop(handle))
            if not jobs:
                continue
            try:
                out = engine.step()
            except Exception as e:  # a bug in the engine: say so once, keep serving
                log.exception("the engine failed on a step of %d requests", len(jobs))
                for ticket in jobs.values():
                    self._fail(ticket, e)
                    self._end(ticket)
                jobs.clear()
                continue
            for handle, item in out:
                ticket = jobs[handle]
                if isinstance(item, Exception):
                    if not isinstance(item, JobError):
                        log.error("the engine failed on a request", exc_info=item)
                    self._fail(ticket, item)
                elif self._deliver(ticket, item):
                    continue
                self._end(jobs.pop(handle))

    def _take(self, running: int) -> list[Ticket]:
        """Wait for work if there is none; then the queued tickets to start, while places are
        free (a ticket cancelled while it waited left the queue already)."""
        with self._cv:
            while not self._queue and not running:
                self._cv.wait()
            started: list[Ticket] = []
            while self._queue and running + len(started) < self.parallel:
                ticket = self._queue.popleft()
                ticket.started = time.monotonic()
                self.running.append(ticket)
                started.append(ticket)
            return started

    def _send(self, ticket: Ticket, item: Item) -> None:
        """Queue an item for its ticket, sent at the end of this turn of the loop."""
        self._outbox.append((ticket, item))

    def _send_all(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            _post(items)

    def _deliver(self, ticket: Ticket, delta: Delta) -> bool:
        """Send a delta to its client; False once it was the last."""
        now = time.monotonic()
        if ticket.first_token is None:
            ticket.first_token = now
        else:
            ticket.token_gaps.append(now - (ticket.last_at or now))
        ticket.last_at = now
        ticket.last = delta
        self._send(ticket, delta)
        if delta.finish_reason is None:
            return True
        self._served(ticket)
        return False

    def _fail(self, ticket: Ticket, err: Exception) -> None:
        """The job ended with an error: the client's (`JobError`) or the engine's, in our words."""
        if isinstance(err, JobError):
            ticket.error = str(err)
            self._send(ticket, err)
        else:
            ticket.error = f"{type(err).__name__}: {err}"
            failed = EngineFailed("the engine failed on this request; see the daemon's log")
            self._send(ticket, failed)
        self._served(ticket)

    def _end(self, ticket: Ticket) -> None:
        """The ticket left the engine: accounted before its client sees the end."""
        ticket.finished = time.monotonic()
        with self._cv:
            self.running.remove(ticket)
        self._after(ticket)
        self._send(ticket, None)

    def _served(self, ticket: Ticket) -> None:
        assert ticket.started is not None
        self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - ticket.started)

    def _after(self, ticket: Ticket) -> None:
        if ticket.cancelled_at is not None and ticket.started is None:
            log.info("request cancelled (%s) while it waited", ticket.cancelled_by)
        elif ticket.cancelled_at is not None and ticket.outcome == "abort":
            assert ticket.finished is not None
            log.info(
                "request cancelled (%s) after %d tokens; engine free %.0f ms later",
                ticket.cancelled_by,
                ticket.last.completion_tokens if ticket.last else 0,
                1000 * max(ticket.finished - ticket.cancelled_at, 0.0),
            )
        for listener in self.listeners:
            try:
                listener(ticket)
            except Exception:
                log.exception("recording a finished request failed")
        with self._cv:
            self._cv.notify_all()  # wait_idle
