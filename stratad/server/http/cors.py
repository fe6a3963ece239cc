"""Cross-origin requests from web pages (CORS), through `aiohttp-cors`; off unless
`server.allowed_origins` names origins.

With origins set, every route answers their preflight (`OPTIONS` with
`Access-Control-Request-Method`) and marks its answers readable by them; a preflight from any
other origin gets 403. The API key still guards the API: a browser page sends it as
`Authorization` or, with Anthropic's SDK, `x-api-key` (both allowed here), not as a cookie,
so credentials mode stays off. A preflight
carries no key, so the guard lets `OPTIONS` through (`stratad.server.app`).
"""

from __future__ import annotations

import aiohttp_cors
from aiohttp import web

PREFLIGHT_MAX_AGE_S = 600
# the key as OpenAI's clients send it (Authorization) and as Anthropic's do (x-api-key, with
# their version and beta headers; the browser SDK adds its own opt-in header)
ALLOWED_HEADERS = ("Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version",
                   "Anthropic-Beta", "Anthropic-Dangerous-Direct-Browser-Access")  # fmt: skip


def enable_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """Answer `origins`' preflights on every route of `app` (call once its routes are in)."""
    if not origins:
        return
    options = aiohttp_cors.ResourceOptions(
        allow_credentials=False,
        allow_headers=ALLOWED_HEADERS,
        allow_methods=("GET", "POST"),
        expose_headers=("Retry-After",),
        max_age=PREFLIGHT_MAX_AGE_S,
    )
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        cors.add(route)
