"""--api-key: every route but the operators' (/health, /metrics, /version) asks for `Authorization: Bearer KEY`, the
header OpenAI's clients send, as vLLM's --api-key does (which guards /v1 only: here /tokenize and /detokenize too). A
request without the key gets a 401 in OpenAI's error shape and reaches no endpoint."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tpgraph.server.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def require_api_key(app: FastAPI, key: str) -> None:
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):  # (in constant time: no key guessed a byte at a time)
            message = ("this server needs an API key: send the header `Authorization: Bearer <key>`" if not given
                       else "the API key is wrong (send the header `Authorization: Bearer <key>`)")
            return JSONResponse(error_body(401, message, "AuthenticationError"), 401,
                                headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
