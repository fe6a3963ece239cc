"""The HTTP front end (aiohttp): routes, the guard middleware, health, models, metrics.

No torch here, directly or through imports: the engine is reached through the scheduler's
`Backend` protocol, attached once the model has loaded (the server answers /health with 503
while it loads). The completion handlers live in `stratad.server.completions`.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import ipaddress
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from aiohttp import web

from stratad.config import ServerConfig
from stratad.runtime.health import health_of
from stratad.runtime.scheduler import STOPPING, Backend, Scheduler, Ticket
from stratad.server.anthropic import routes as anthropic
from stratad.server.completions import Completions, presented_key
from stratad.server.errors import error_response
from stratad.server.http.cors import enable_cors
from stratad.server.llama.routes import PATHS as LLAMA_PATHS
from stratad.server.llama.routes import LlamaRoutes
from stratad.server.metrics import CONTENT_TYPE, Collector, ServerMetrics, StoreView
from stratad.server.openai import requests as oa
from stratad.server.openai import responses as rs
from stratad.server.openai.embeddings import Embeddings
from stratad.server.openapi import render as render_openapi
from stratad.server.tokens import TokenRoutes

FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
CLIENT_CLOSED = 499  # a request whose client left before it was read (nginx's code)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


log = logging.getLogger("stratad.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """The DNS-rebinding guard: IP literals and localhost always, other names if listed.

    A rebinding attack needs a name the attacker controls, so a Host that is an IP address
    is safe; a name must be `localhost` or in `allowed` (`"*"` allows any, `.example.com`
    its subdomains too).
    """
    if host is None or "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name == "localhost" or name.endswith(".localhost"):
        return True
    for entry in (a.lower().rstrip(".") for a in allowed):
        if name == entry.lstrip(".") or (entry.startswith(".") and name.endswith(entry)):
            return True
    return False


DRAIN_RETRY_AFTER_S = 30
OPEN_PATHS = frozenset({"/v1/health"})  # under /v1/ but, like /health, open without the key
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"}) | LLAMA_PATHS  # outside /v1/ but keyed


def needs_key(path: str) -> bool:
    """Whether `server.api_key` guards `path`: the API (/v1/ and the tokenizer), not the
    operator's routes (/health, /metrics, /openapi.json)."""
    return (path.startswith("/v1/") and path not in OPEN_PATHS) or path in KEYED_PATHS


class Server:
    """The aiohttp application, its scheduler and its metrics."""

    def __init__(self, config: ServerConfig, model_name: str | None = None) -> None:
        self.config = config
        self.model_name = model_name
        self.metrics = ServerMetrics()
        if model_name:
            self.metrics.serve(model_name)
        self.scheduler = Scheduler(config.max_queue, on_finished=self._finished)
        self.metrics.bind_scheduler(
            running=lambda: float(self.scheduler.num_running),
            waiting=lambda: float(self.scheduler.waiting),
        )
        self._loader: threading.Thread | None = None
        self.degraded: Callable[[], str | None] = lambda: None
        # whether the daemon pins its resident set while it loads (the operations set it)
        self.pinning: Callable[[], bool] = lambda: False
        """Why the daemon serves short of its configuration (set once the engine is known)."""
        self.openapi = render_openapi()
        self.completions = Completions(self.scheduler, config, self.metrics)
        self.tokens = TokenRoutes(config.body_timeout_s)
        self.llama = LlamaRoutes(self.completions)  # llama-server's native API
        self.anthropic = anthropic.Messages(self.completions)
        self.embeddings = Embeddings(self.completions, config.embeddings)
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._guard])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.completions.chat),
                web.post("/v1/completions", self.completions.text),
                web.post("/v1/embeddings", self.embeddings.create),
                web.post(anthropic.MESSAGES, self.anthropic.messages),
                web.post(anthropic.COUNT_TOKENS, self.anthropic.count_tokens),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{id:.+}", self.model),
                web.get("/health", self.health_route),
                web.get("/v1/health", self.health_route),
                web.post("/tokenize", self.tokens.tokenize),
                web.post("/detokenize", self.tokens.detokenize),
                web.get("/metrics", self.metrics_text),
                web.get("/openapi.json", self.openapi_json),
                *self.llama.routes(),
            ]
        )
        enable_cors(self.app, config.allowed_origins)

    def attach(self, engine: Backend) -> None:
        """The model is loaded: serve it."""
        self.model_name = engine.model_id
        self.metrics.serve(engine.model_id)
        self.tokens.codec = self.llama.codec = getattr(engine, "tokenizer", None)
        self.tokens.max_context = engine.max_context
        gauges = getattr(engine, "gauges", None)
        if gauges is not None:
            self.add_metrics(gauges)
        self.scheduler.attach(engine)

    def load_in_background(
        self, load: Callable[[], Backend], failed: Callable[[BaseException], None]
    ) -> None:
        """Once the app starts, run `load` on a thread and serve what it returns.

        Until then /health answers 503 "loading"; if it raises, `failed` gets the exception on
        the event loop (the daemon logs it and stops).
        """

        async def start(app: web.Application) -> None:
            loop = asyncio.get_running_loop()

            def work() -> None:
                try:
                    engine = load()
                    warm_up = getattr(engine, "warm_up", None)
                    if warm_up is not None:
                        warm_up()
                    # what the load made (torch's modules, the model's tables: ~245K objects
                    # with the default model) leaves the collector's walks: a full collection
                    # over them took 50-110 ms on the 2-core VM, a stall in some stream
                    gc.collect()
                    gc.freeze()
                except BaseException as e:  # reported, then the daemon exits
                    self.scheduler.state = "failed"
                    loop.call_soon_threadsafe(failed, e)
                    return
                loop.call_soon_threadsafe(self.attach, engine)

            self._loader = threading.Thread(target=work, name="loader", daemon=True)
            self._loader.start()

        self.app.on_startup.append(start)

    @property
    def loading(self) -> bool:
        """The model is still loading on its thread."""
        return self._loader is not None and self._loader.is_alive()

    async def drain(self) -> None:
        """Stopping: refuse new requests, give those in flight `server.drain_timeout_s`
        (`stratad.control.lifecycle` runs the shutdown)."""
        self.scheduler.begin_drain(STOPPING)
        if self.scheduler.engine is not None:
            await self.scheduler.drain(self.config.drain_timeout_s)

    def cancel_all(self) -> int:
        """A forced stop: cancel every request in flight; how many there were."""
        return self.scheduler.cancel_all()

    # --- what the control socket asks (stratad.control.state.Serving) -----------------------

    def health(self) -> oa.Health:
        """The one health body: /health serves it, the control socket's status carries it."""
        return health_of(self.scheduler, self.model_name, self.degraded(), self.pinning())

    def begin_drain(self, reason: str) -> None:
        self.scheduler.begin_drain(reason)

    def undrain(self) -> bool:
        return self.scheduler.undrain()

    def wait_idle(self, timeout_s: float) -> int:
        return self.scheduler.wait_idle(timeout_s)

    def hold(self, reason: Literal["pinning"] | None) -> None:
        """Refuse completions with 503 (and say `reason` on /health) until `hold(None)`.

        For a store that must finish pinning before the daemon counts as ready.
        """
        self.scheduler.held = reason

    def add_metrics(self, collector: Collector) -> None:
        """Extra samples read at every scrape: `(name, help, labels, value)` tuples."""
        self.metrics.add_collector(collector)

    def watch_store(self, view: StoreView) -> None:
        """/metrics reads the expert store through `view` (the control socket's own)."""
        self.metrics.watch_store(view)

    # --- middleware ----------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "other"
        response = await self._guarded(request, handler)
        if anthropic.owns(request.path):
            response = anthropic.anthropic_error(response)
        self.metrics.http_requests.inc(handler=name, status=str(response.status))
        return response

    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not host_allowed(request.headers.get("Host"), self.config.allowed_hosts):
            log.warning(
                "refused a request for Host %r (not in server.allowed_hosts)",
                request.headers.get("Host"),
            )
            return error_response(403, "this Host is not allowed (server.allowed_hosts)", None)
        # a CORS preflight never carries the key (without server.allowed_origins: 405)
        if self.config.api_key and request.method != "OPTIONS" and needs_key(request.path):
            given = presented_key(request)  # `Authorization`, or Anthropic's `x-api-key`
            expected = f"Bearer {self.config.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                response = error_response(
                    401,
                    "missing or wrong API key",
                    None,
                    code="invalid_api_key",
                    kind="authentication_error",
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        if request.method == "POST" and self.scheduler.state == "draining":
            response = error_response(
                503, f"the server is draining ({self.scheduler.drain_reason}): it finishes the"
                " requests in flight and takes no new ones", None, code="draining",
                retry_after=DRAIN_RETRY_AFTER_S,
            )  # fmt: skip
            response.force_close()  # a kept-alive client's next request goes elsewhere
            return response
        # the types a web page may post cross-site without asking first: JSON only here
        typed = request.headers.get("Content-Type") is not None
        if request.method == "POST" and typed and request.content_type in FORM_TYPES:
            return error_response(
                415, f"the body must be JSON (Content-Type: application/json), not"
                f" {request.content_type}", None,
            )  # fmt: skip
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            return error_response(
                413, f"request body over {self.config.max_body_bytes} bytes", None
            )
        try:
            return await handler(request)
        except web.RequestPayloadError as e:  # e.g. Content-Encoding: gzip on a plain body
            request.content.feed_eof()  # the rest of the stream is not read (nor logged)
            response = error_response(400, f"cannot read the request body: {_one_line(e)}", None)
            response.force_close()
            return response
        except ConnectionResetError:  # the client hung up while it sent the body
            log.info("%s %s: the client went away before its body arrived", request.method,
                     request.path)  # fmt: skip
            return web.Response(status=CLIENT_CLOSED)
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 while reading, ...
            if e.status < 400:
                raise
            response = error_response(e.status, e.reason, None)
            for key in ("Allow",):
                if key in e.headers:
                    response.headers[key] = e.headers[key]
            return response
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(500, "internal server error; see the daemon's log", None)

    # --- small routes --------------------------------------------------------------------

    def _card(self, engine: Backend) -> rs.ModelCard:
        return rs.ModelCard(
            id=engine.model_id,
            object="model",
            created=int(time.time()),
            owned_by="strata",
            max_model_len=engine.max_context,
        )

    async def models(self, request: web.Request) -> web.Response:
        engine = self.scheduler.engine
        if engine is None:
            return self.completions.unavailable()
        body = rs.ModelList(object="list", data=[self._card(engine)])
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        """One model's card, or OpenAI's 404 for an id this daemon does not serve."""
        engine = self.scheduler.engine
        if engine is None:
            return self.completions.unavailable()
        wanted = request.match_info["id"]
        if wanted != engine.model_id:
            return error_response(
                404, f"The model `{wanted}` does not exist (this server serves"
                f" `{engine.model_id}`)", "model", code="model_not_found",
            )  # fmt: skip
        return web.Response(
            body=msgspec.json.encode(self._card(engine)), content_type="application/json"
        )

    async def health_route(self, request: web.Request) -> web.Response:
        body = self.health()
        return web.Response(
            status=200 if body.serving else 503,
            body=msgspec.json.encode(body),
            content_type="application/json",
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"},
        )

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.Response(body=self.openapi, content_type="application/json")

    # --- bookkeeping (on the engine thread) ------------------------------------------------

    def _finished(self, t: Ticket) -> None:
        m, outcome = self.metrics, t.outcome
        prompt = len(t.prepared.prompt)
        m.request_success.inc(finished_reason=outcome)
        assert t.finished is not None
        m.e2e.observe(t.finished - t.submitted)
        if t.started is None:
            return  # cancelled while it waited
        m.queue_time.observe(t.started - t.submitted)
        if t.cancelled_at is not None and outcome == "abort" and t.cancelled_by == "client":
            m.cancel_latency.observe(max(t.finished - t.cancelled_at, 0.0))
        generated = t.last.completion_tokens if t.last else 0
        cached = t.last.cached_tokens if t.last else 0
        m.prompt_tokens.inc(prompt)
        m.prompt_hist.observe(prompt)
        m.prefix_queries.inc(prompt)
        m.prefix_hits.inc(cached)
        m.generation_tokens.inc(generated)
        m.generation_hist.observe(generated)
        if t.first_token is not None:
            m.ttft.observe(t.first_token - t.submitted)
            m.prefill_time.observe(t.first_token - t.started)
            m.decode_time.observe(t.finished - t.first_token)
        for gap in t.token_gaps:
            m.itl.observe(gap)
        log.info(
            "%s: %d prompt tokens (%d cached) + %d generated, queued %.2f s, first token %s,"
            " total %.2f s",
            outcome,
            prompt,
            cached,
            generated,
            t.started - t.submitted,
            f"{t.first_token - t.submitted:.2f} s" if t.first_token else "-",
            t.finished - t.submitted,
        )
