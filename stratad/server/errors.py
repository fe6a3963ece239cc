"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from aiohttp import web

from stratad.server.openai.responses import error_body


def error_response(
    status: int,
    message: str,
    param: str | None,
    *,
    code: str | None = None,
    kind: str | None = None,
    retry_after: int | None = None,
) -> web.Response:
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(
        status=status,
        body=error_body(message, kind, param, code),
        content_type="application/json",
        headers=headers,
    )


def param_of(message: str) -> str | None:
    """The field path in a msgspec error ("... - at `$.messages[0].role`" -> "messages[0].role")."""
    path = message.rsplit("`$.", 1)[1].rstrip("`") if "`$." in message else None
    if message.startswith("Object contains unknown field `"):
        name = message.split("`", 2)[1]
        return f"{path}.{name}" if path else name
    return path
