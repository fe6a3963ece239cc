"""The daemon's operational life: control socket, systemd notifications, watchdog, shutdown.

    ops = Operations(config)
    ops.start()                      # control socket up, STATUS=loading
    server = Server(...)
    ops.install(server)              # request counting, STOPPING=1, health and drain
    ... the model loads (on a thread) ...; ops.loaded(engine)
    ops.serve(app)                   # listen; READY=1 once the model serves; WATCHDOG=1 pings;
                                     # SIGTERM: STOPPING=1, the app drains, the socket closes

Shutdown: the first SIGTERM/SIGINT refuses new requests at once (503 with Retry-After, on
kept-alive connections too, which then close), stops listening, gives the requests in flight
`server.drain_timeout_s`, then closes the connections; a second signal cancels what is left
and stops now (`stratad.control.signals`).

The watchdog is pinged from the HTTP event loop itself, so a wedged loop stops the pings and
systemd restarts the daemon. With `store.ready_after_pinning` the engine returns only once the
resident set is pinned, so READY=1 waits for pinning too; STATUS= shows the progress either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from stratad.config import Config
from stratad.control.gate import gate_middleware, meter_ticket
from stratad.control.server import (
    ControlError,
    ControlServer,
    SocketHeld,
    parse_mode,
    resolve_group,
)
from stratad.control.signals import StopSignals, exit_later
from stratad.control.state import DaemonState, EngineView, StoreView
from stratad.control.store_view import store_view_of
from stratad.protocol import Progress
from stratad.runtime.scheduler import STOPPING
from stratad.server.http.listener import (
    CappedSite,
    connection_cap,
    handler_args,
    quiet_accept_errors,
)
from stratad.systemd import EVENT_FIELD, Notifier, SystemdEnv, classify, event, journal_handler

log = logging.getLogger("stratad")

STATUS_INTERVAL_S = 1.0  # at most one STATUS= line a second while pinning
PIN_POLL_S = 0.5
SHUTDOWN_GRACE_S = 2.0  # after the drain: for answers still being written out
FORCED_CLEANUP_S = 0.5  # after a second stop signal: for the cancelled requests' last words


class _EventTagger(logging.Filter):
    """Adds STRATA_EVENT to key lines that were logged without one (journal only)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, EVENT_FIELD):
            kind = classify(record.name, record.levelno, record.getMessage())
            if kind is not None:
                setattr(record, EVENT_FIELD, kind)
        return True


def engine_view(engine: Any) -> EngineView:
    """The control socket's view of `stratad.runtime.service.Engine` (duck-typed: no torch here)."""
    info = engine.info
    spec = engine.model.spec
    vram = None
    if str(info.device).startswith("cuda"):
        torch = sys.modules["torch"]  # the engine imported it; this module never does

        def vram() -> tuple[int, int]:
            free, total = torch.cuda.mem_get_info(info.device)
            return int(total - free), int(total)

    return EngineView(
        model=info.model_id,
        arch=info.arch,
        device=str(info.device),
        moe=bool(spec.is_moe),
        vram=vram,
    )


class Operations:
    def __init__(
        self, config: Config, sd_env: SystemdEnv | None = None,
        signals: StopSignals | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.signals = signals or StopSignals()
        self.sd_env = sd_env or SystemdEnv.read()
        self.state = DaemonState()
        self.notifier = Notifier(self.sd_env)
        self.control: ControlServer | None = None
        self._last_status = 0.0
        self._pinned = False  # "pinning done" said (the pinner may report its end twice)
        self._watchdog_task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: Any = None
        self._http: Any = None  # stratad.server.app.Server
        self._drain_task: asyncio.Future[None] | None = None
        self._forced = False

    # ---- start ---------------------------------------------------------------------------

    def start(self) -> None:
        """Journal logging, the control socket, STATUS=loading.

        A bad control.mode or control.group raises ControlError (a config error), and so does
        another live daemon on the socket's path (`SocketHeld`: this one would serve where
        stratactl cannot reach it); a socket that cannot be set up otherwise (its directory
        not writable) costs stratactl, not serving: one WARNING.
        """
        handler = journal_handler(self.sd_env)
        if handler is not None:
            root = logging.getLogger()
            handler.setLevel(root.level)
            handler.addFilter(_EventTagger())
            for h in list(root.handlers):
                root.removeHandler(h)
            root.addHandler(handler)
        c = self.config.control
        if c.socket:
            control = ControlServer(
                Path(c.socket), self.state, mode=parse_mode(c.mode), gid=resolve_group(c.group),
                max_clients=c.max_clients, max_clients_per_peer=c.max_clients_per_peer,
                idle_timeout_s=c.idle_timeout_s,
            )  # fmt: skip
            try:
                control.start()
                self.control = control
            except SocketHeld:
                raise
            except ControlError as e:
                log.warning("no control socket, stratactl cannot reach this daemon: %s", e)
        self.state.set_state("loading")
        model = self.config.model.path or "the default model"
        self.notifier.status(f"loading {model}")

    def install(self, server: Any) -> None:
        """Hook into the HTTP side (`stratad.server.app.Server`) before it starts: request
        counting, STOPPING=1, and the control socket's view of it (health, queue, drain)."""
        app: web.Application = server.app
        app.middlewares.insert(0, gate_middleware(self.state))
        app.on_shutdown.append(self._on_shutdown)
        self._scheduler = server.scheduler
        self._http = server
        server.pinning = lambda: self.state.state == "pinning"  # /health says so while loading
        server.scheduler.listeners.append(lambda ticket: meter_ticket(self.state, ticket))
        self.state.serving = server

    def loaded(self, engine: Any) -> None:
        """The model is loaded: the control socket can describe it (and its expert store,
        when the engine runs one: `engine.store`, see stratad.control.store_view)."""
        self.state.engine = engine_view(engine)
        counters = getattr(engine, "counters", None)
        if callable(counters):
            self.state.engine_counters = counters
        self.notifier.status(f"{self.state.engine.model} loaded")
        view = store_view_of(engine, self.config)
        if view is not None:
            self.attach_store(view)
            if self._http is not None:  # a blob that fails its checksum: /health "degraded"
                self._http.degraded = view.damaged
                self._http.watch_store(view)  # /metrics reads the same view
            pinner = getattr(view.store, "pinner", None)
            if pinner is not None:
                threading.Thread(
                    target=self._watch_pinning, args=(pinner, view), name="pin-progress",
                    daemon=True,
                ).start()  # fmt: skip

    # ---- the expert store (adapter: stratad.control.store_view) ---------------------------

    def attach_store(self, store: StoreView) -> None:
        self.state.store = store

    def pin_progress_callback(self) -> Callable[[Any], None]:
        """For `open_store(on_pin_progress=...)`: the store's `PinProgress` reports."""
        return lambda p: self.pinning_progress(p.pinned_bytes, p.planned_bytes, p.rate_bps)

    def _watch_pinning(self, pinner: Any, view: Any) -> None:
        while True:
            p = pinner.progress
            self.pinning_progress(p.pinned_bytes, p.planned_bytes, p.rate_bps)
            if p.pinned_bytes >= p.planned_bytes or self.state.state == "stopping":
                break
            time.sleep(PIN_POLL_S)
        if pinner.wait(PIN_POLL_S * 10) and (damaged := view.damaged()) is not None:
            log.warning("coverage: %s", damaged, extra=event("coverage"))

    def pinning_progress(self, done: int, total: int, rate_bytes_s: float = 0.0) -> None:
        """The store's pinning callback (any thread): control-socket status and STATUS=."""
        eta = (total - done) / rate_bytes_s if rate_bytes_s > 0 else None
        self.state.pinning = Progress(
            done_bytes=done, total_bytes=total, rate_bytes_s=rate_bytes_s, eta_s=eta
        )
        finished = done >= total
        if self.state.state in ("loading", "starting") and not finished:
            self.state.set_state("pinning")
        now = time.monotonic()
        if finished or now - self._last_status >= STATUS_INTERVAL_S:
            self._last_status = now
            pct = 100.0 * done / total if total else 100.0
            eta_text = f", ETA {eta:.0f} s" if eta is not None and not finished else ""
            self.notifier.status(
                f"pinning experts: {done / 2**30:.1f} of {total / 2**30:.1f} GiB ({pct:.0f}%)"
                f"{eta_text}"
            )
        if finished and not self._pinned:
            self._pinned = True
            log.info("pinning done: %.2f GiB page-locked", total / 2**30, extra=event("pinning"))
            if self.state.state == "pinning":
                self.state.set_state("loading" if self._stop is None else "serving")

    # ---- serving -------------------------------------------------------------------------

    def ready(self, url: str) -> None:
        """HTTP listens and the model serves: READY=1, and the watchdog starts (call it on the
        HTTP event loop, so that the pings stop if that loop wedges)."""
        self.state.set_state("serving")
        model = self.state.engine.model if self.state.engine else "?"
        self.notifier.ready(f"serving {model} on {url}")
        log.info("serving %s on %s", model, url, extra=event("ready"))
        interval = self.sd_env.watchdog_interval_s
        if interval is not None and self._watchdog_task is None:
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog(interval))

    def stopping(self) -> None:
        if self.state.state == "stopping":
            return
        self.state.set_state("stopping")
        self.notifier.stopping()
        log.info("stopping", extra=event("stopping"))

    async def _on_shutdown(self, app: web.Application) -> None:
        self.stopping()

    def _first_signal(self) -> None:
        log.info("%s: stopping (a second one forces it)", self.signals.requested)
        if self._stop is not None:
            self._stop.set()

    def _second_signal(self) -> None:
        if self._forced:
            return
        self._forced = True
        cancelled = self._http.cancel_all() if self._http is not None else 0
        log.warning("stop signal again: stopping now, %d request(s) cancelled", cancelled)
        if self._drain_task is not None:
            self._drain_task.cancel()
        if self._stop is not None:
            self._stop.set()
        exit_later()

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval_s)

    def serve(self, app: web.Application) -> None:
        """Serve HTTP (server.host, server.port) until SIGTERM/SIGINT (or `stop()`), then shut
        down (the app's on_shutdown hooks run: in-flight requests finish), then close the
        control socket."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(app))
        finally:
            try:  # as asyncio.run ends, but for the executor when forced
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                if not self._forced:  # forced: what still runs on a thread is left (`forced`)
                    loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                self.close()

    @property
    def forced(self) -> bool:
        """A second stop signal came: the caller exits at once when `serve` returns, without
        waiting for work still on a thread (a request's tokenizer or chat template)."""
        return self._forced

    def _serving_ready(self) -> bool:
        if self.state.engine is None:
            return False
        return self._scheduler is None or getattr(self._scheduler, "state", "ready") == "ready"

    def stop(self) -> None:
        """Ask `serve` to return (any thread)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _serve(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = stop = asyncio.Event()
        self.signals.attach(self._loop, self._first_signal, self._second_signal)
        quiet_accept_errors(self._loop, log)
        if stop.is_set():  # a signal came while the daemon started: stop before serving
            self.stopping()
            return
        sc = self.config.server
        host, port = sc.host, sc.port
        runner = web.AppRunner(
            app, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S, **handler_args(sc)
        )
        await runner.setup()
        site: CappedSite | None = None
        try:
            site = CappedSite(runner, host, port, connection_cap(sc.max_connections))
            await site.start()
            # The model may still be loading on a thread (the app answers 503 meanwhile):
            # READY=1 once it serves.
            while not self._serving_ready() and not stop.is_set():
                await asyncio.sleep(0.05)
            if not stop.is_set():
                self.ready(f"http://{host}:{port}")
            await stop.wait()
        finally:
            self.stopping()
            if self._watchdog_task is not None:
                self._watchdog_task.cancel()
            await self._shut_down(runner, site)

    async def _shut_down(self, runner: web.AppRunner, site: CappedSite | None) -> None:
        """Refuse new requests, stop listening, drain, then close the connections."""
        if self._http is not None:
            self._http.begin_drain(STOPPING)  # kept-alive connections get 503 from now on
        if site is not None and site.started:
            await site.stop()
        if self._http is not None and not self._forced:
            self._drain_task = asyncio.ensure_future(self._http.drain())
            with contextlib.suppress(asyncio.CancelledError):  # a second signal
                await self._drain_task
        if not self._forced:
            await runner.cleanup()
            return
        # forced: the cancelled requests' last words go out at once; a handler still waiting
        # on a thread (a chat template that never ends) is not waited for
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(runner.cleanup(), FORCED_CLEANUP_S)

    def close(self) -> None:
        if self.control is not None:
            self.control.stop()
            self.control = None
        self.notifier.close()
