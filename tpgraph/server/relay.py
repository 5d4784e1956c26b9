"""Several front ends (--api-server-count) share one listening socket, and the kernel hands each connection to any of
them; the Responses API's store, though, lives in front end 0 alone (frontend.py's FrontendSpec). So every other front
end relays each request under /v1/responses to front end 0, over its private Unix socket, as a reverse proxy: the
request (method, path, query, end-to-end headers, body) goes on as it comes, and front end 0's reply (status, headers,
body) comes back chunk by chunk as it arrives (an SSE stream is not held back). A client that goes away closes the
relayed request, so front end 0 hears it go and aborts; a front end 0 that cannot be reached is a 503.

Outermost, before auth, CORS and request ids: front end 0 applies those (and counts and logs the request) itself.
Plain ASGI middleware (auth.py says why not BaseHTTPMiddleware)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from urllib.parse import quote_from_bytes

import anyio
import httpx2 as httpx  # (httpx's successor, of the same API, which openai's and anthropic's SDKs bring)
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tpgraph.server.auth import route_path
from tpgraph.server.errors import error_body

logger = logging.getLogger(__name__)
RESPONSES_PATH = "/v1/responses"
# headers that concern one connection only (RFC 9110 7.6.1), never passed on; also those the Connection header names.
# expect: this front end answered it already. date, server: uvicorn sets its own on the reply it sends
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
NOT_SENT_ON = HOP_BY_HOP | {b"expect"}
NOT_SENT_BACK = HOP_BY_HOP | {b"date", b"server"}
CONNECT_TIMEOUT_S = 5.0  # (a relayed request may then take as long as it runs: a response's stream, a long answer)
SAFE_PATH_BYTES = "".join(map(chr, range(0x21, 0x7F)))  # (a raw path's bytes outside printable ASCII are %-escaped)


def is_responses_path(path: str) -> bool:
    """Is this (a route's path) the Responses API's? (/v1/responses and below it, not /v1/responsesX)"""
    return path == RESPONSES_PATH or path.startswith(RESPONSES_PATH + "/")


class ClientGone(Exception):
    """The client went away while its request's body was being relayed."""


class Relay:
    """An ASGI app that relays every request to the server on the Unix socket `uds`, through one connection pool kept
    for the app's life (aclose at its shutdown)."""

    def __init__(self, uds: str, keepalive_s: float = 2.0) -> None:
        """keepalive_s: how long an idle connection to the server is kept for the next request: under the server's own
        keep-alive timeout, so that one is not reused just as the server closes it."""
        self.uds, self.keepalive_s = uds, keepalive_s
        self._client: httpx.AsyncClient | None = None  # (made on the first request, on the loop that serves it)

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            transport = httpx.AsyncHTTPTransport(uds=self.uds, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=64, keepalive_expiry=self.keepalive_s))
            # (trust_env off: a proxy named in the environment, HTTP_PROXY, would take the requests off the socket)
            self._client = httpx.AsyncClient(transport=transport, trust_env=False,
                                             timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_read = anyio.Event()
        async with anyio.create_task_group() as tasks:
            # (the client's going away, heard once its body is read, cancels the relay: the relayed request closes)
            tasks.start_soon(self._cancel_when_gone, receive, body_read, tasks.cancel_scope)
            await self._relay(scope, receive, send, body_read)
            tasks.cancel_scope.cancel()

    async def _relay(self, scope: Scope, receive: Receive, send: Send, body_read: anyio.Event) -> None:
        request = httpx.Request(scope["method"], _target(scope), headers=_end_to_end(scope["headers"], NOT_SENT_ON),
                                content=_body(scope, receive, body_read))
        try:
            response = await self.client().send(request, stream=True)
        except ClientGone:
            return
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            logger.warning("cannot relay %s %s to front end 0 at %s: %s", scope["method"], scope["path"], self.uds,
                           reason)
            message = f"the Responses API is served by front end 0, which cannot be reached: {reason}"
            return await JSONResponse(error_body(503, message, "ServiceUnavailableError"), 503)(scope, receive, send)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": _end_to_end([(k.lower(), v) for k, v in response.headers.raw], NOT_SENT_BACK)})
            async for chunk in response.aiter_raw():  # (as it comes: no decoding, no buffering)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.TransportError as exc:  # (left incomplete: uvicorn closes the connection, the client sees a cut)
            logger.warning("front end 0's reply to %s %s broke off: %s", scope["method"], scope["path"],
                           str(exc) or type(exc).__name__)
        finally:
            with anyio.CancelScope(shield=True):  # (also when cancelled: a reply not read to its end closes its
                await response.aclose()           # connection, which tells front end 0 its client went away)

    @staticmethod
    async def _cancel_when_gone(receive: Receive, body_read: anyio.Event, scope: anyio.CancelScope) -> None:
        await body_read.wait()
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()


class RelayMiddleware:
    """Hands each request under /v1/responses to `relay`, every other to the app (for them: one prefix check)."""

    def __init__(self, app: ASGIApp, relay: Relay) -> None:
        self.app, self.relay = app, relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_responses_path(route_path(scope)):
            return await self.relay(scope, receive, send)
        await self.app(scope, receive, send)


def _target(scope: Scope) -> httpx.URL:
    """The request's path and query as the client sent them (with the --root-path prefix, where it came with one:
    front end 0 reads it as this one does)."""
    target = scope.get("raw_path") or scope["path"].encode()
    if query := scope.get("query_string", b""):
        target += b"?" + query
    return httpx.URL("http://localhost").copy_with(raw_path=quote_from_bytes(target, SAFE_PATH_BYTES).encode())


def _end_to_end(headers: list[tuple[bytes, bytes]], dropped: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """The headers (lower-case names) but those of one connection: `dropped`, and those its Connection header names."""
    named = {token.strip().lower() for name, value in headers if name == b"connection" for token in value.split(b",")}
    return [(name, value) for name, value in headers if name not in dropped and name not in named]


def _body(scope: Scope, receive: Receive, body_read: anyio.Event) -> AsyncIterator[bytes] | None:
    """The request's body as it comes (None where it has none: then body_read is set at once)."""
    names = {name for name, _ in scope["headers"]}
    if b"content-length" not in names and b"transfer-encoding" not in names:
        body_read.set()
        return None
    return _body_chunks(receive, body_read)


async def _body_chunks(receive: Receive, body_read: anyio.Event) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body", False):
            break
    body_read.set()
