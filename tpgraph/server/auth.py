"""--api-key: every route but the operators' (/health, /ping, /metrics, /version) and the API docs asks for
`Authorization: Bearer KEY`, the header OpenAI's clients send (or `x-api-key: KEY`, Anthropic's), as vLLM's --api-key
does (which guards /v1 only: here /tokenize and /detokenize too). A request without the key gets a 401 in OpenAI's
error shape (the Messages API's in Anthropic's, which its clients read) and reaches no endpoint.
The docs stay open as vLLM leaves them: Swagger UI's page cannot send the key, and the schema is no secret.

Plain ASGI middleware, not FastAPI's @app.middleware("http"): that wraps each request in Starlette's
BaseHTTPMiddleware, behind which an endpoint never hears that its client went away (`request.is_disconnected()` stays
false), so a request whose client left would run on to its end."""

from __future__ import annotations

import hashlib
import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tpgraph.server.errors import is_messages_path, refusal_body

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/openapi.json"})


def route_path(scope: Scope) -> str:
    """The path the routes match: behind --root-path ("/llm"), a request comes with the prefix (a proxy that passes it
    on: /llm/health) or without it (one that strips it: /health)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str | tuple[str, ...]) -> None:
        """key: the key, or several (vLLM's --api-key KEY...), any of which a client may send."""
        self.app = app
        # (kept as SHA-256 digests of their UTF-8, as vLLM's: a key need not be ASCII, and a digest is compared with
        # a digest, of one length whatever a client sends)
        self.expected = [_digest(k.encode()) for k in ((key,) if isinstance(key, str) else key)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # (a trailing slash too: /metrics/ is redirected to /metrics, open, not refused for want of a key)
        if scope["type"] != "http" or route_path(scope).rstrip("/") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        # (the scheme in any case, as HTTP's schemes are and as vLLM reads it: `bearer KEY` too; the key exactly)
        scheme, _, sent = given.partition(b" ")
        # Anthropic's clients send the key as `x-api-key: KEY` (the Messages API's header)
        header_key = next((value for name, value in scope["headers"] if name == b"x-api-key"), None)
        if scheme.lower() == b"bearer" and self._taken(sent) or header_key is not None and self._taken(header_key):
            return await self.app(scope, receive, send)
        path = route_path(scope)
        header = "x-api-key: <key>" if is_messages_path(path) else "Authorization: Bearer <key>"
        message = (f"this server needs an API key: send the header `{header}`" if not given and header_key is None
                   else f"the API key is wrong (send the header `{header}`)")
        response = JSONResponse(refusal_body(path, 401, message, "AuthenticationError"), 401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _taken(self, sent: bytes) -> bool:
        # (each key compared in constant time, and all of them: no key guessed a byte at a time, nor which one matched;
        # as digests: compare_digest's time tells the lengths of what it compares where they differ)
        given = _digest(sent)
        return sum(secrets.compare_digest(given, expected) for expected in self.expected) > 0


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
