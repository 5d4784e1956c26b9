"""Request ids as vLLM's server gives them: a client's `X-Request-Id` header names its request, and the reply's id is
`cmpl-<it>` or `chatcmpl-<it>`; without the header, the body's `request_id` (vLLM's field), else a new hex id. With
--enable-request-id-headers every response carries the header too, the id the reply's body names. The Messages API's
replies carry it always as `request-id`, the header Anthropic's SDKs read it from (a message's _request_id).

Plain ASGI middleware (auth.py says why not BaseHTTPMiddleware)."""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpgraph.server.auth import route_path
from tpgraph.server.errors import is_messages_path

HEADER = b"x-request-id"
ANTHROPIC_HEADER = b"request-id"  # (Anthropic's API sends each reply's id so, and its SDKs read it)
# where the middleware keeps the id its response header will carry (the endpoint may name it from the body)
SCOPE_KEY = "tpgraph.request_id"


def _given(scope: Scope) -> bytes:
    """The request's X-Request-Id as sent (b"" without one)."""
    return next((value for name, value in scope["headers"] if name == HEADER), b"")


def _header_value(text: str) -> bool:
    """Whether HTTP can send `text` as a header's value: no control character, and no space at either end (h11,
    uvicorn's, refuses the response start otherwise, and the reply is lost)."""
    return text.isprintable() and text == text.strip()


def request_id(request: Request, from_body: str | None = None) -> str:
    """The client's X-Request-Id, else the body's request_id (from_body), else a new id (the middleware's, where it
    runs); the middleware's response header is told which."""
    raw = _given(request.scope)
    try:  # (as the client wrote it: the header goes back as these bytes)
        given = raw.decode("utf-8")
    except UnicodeDecodeError:
        given = raw.decode("latin-1")
    holder: dict | None = request.scope.get(SCOPE_KEY)
    if not given and from_body:
        given = from_body
        if holder is not None and _header_value(from_body):
            holder["id"] = from_body.encode()
    if given:
        return given
    return holder["id"].decode() if holder is not None else uuid.uuid4().hex


class RequestIdMiddleware:
    """Every response carries X-Request-Id (every_response; else none does): the request's, or the one the endpoint
    named it by (request_id), or one made for it; the Messages API's carry it as request-id too, whatever
    every_response says."""

    def __init__(self, app: ASGIApp, every_response: bool = True) -> None:
        self.app = app
        self.every_response = every_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = [HEADER] if self.every_response else []
        if is_messages_path(route_path(scope)):
            names.append(ANTHROPIC_HEADER)
        if not names:
            return await self.app(scope, receive, send)
        holder = {"id": _given(scope) or uuid.uuid4().hex.encode()}
        scope = {**scope, SCOPE_KEY: holder}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() not in names]
                message = {**message, "headers": [*headers, *((name, holder["id"]) for name in names)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
