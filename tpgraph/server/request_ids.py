"""Request ids as vLLM's server gives them: a client's `X-Request-Id` header names its request, and the reply's id is
`cmpl-<it>` or `chatcmpl-<it>` (a new hex id where the client sent none). With --enable-request-id-headers every
response carries the header too, the client's or the one made for it, the same id the reply's body names.

Plain ASGI middleware (auth.py says why not BaseHTTPMiddleware)."""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


def _given(scope: Scope) -> bytes:
    """The request's X-Request-Id as sent (b"" without one)."""
    return next((value for name, value in scope["headers"] if name == HEADER), b"")


def request_id(request: Request) -> str:
    """The client's X-Request-Id, or a new id."""
    raw = _given(request.scope)
    try:  # (as the client wrote it: the header goes back as these bytes)
        given = raw.decode("utf-8")
    except UnicodeDecodeError:
        given = raw.decode("latin-1")
    return given or uuid.uuid4().hex


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the request's, or one made for it (and handed to the endpoint, as if the
    client had sent it, so the reply's body names the same id)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _given(scope)
        if not given:
            given = uuid.uuid4().hex.encode()
            # (any empty ones dropped: the endpoint must read the id the response header carries)
            scope = {**scope, "headers": [*((n, v) for n, v in scope["headers"] if n != HEADER), (HEADER, given)]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
