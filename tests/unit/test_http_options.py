"""vLLM's HTTP flags (server/options.py): in process (httpx over ASGI, no engine), CORS; in a front-end process of
its own (uvicorn, no engine), uvicorn's logs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.request

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import IdleClient, builtin_codec, httpx_module  # noqa: E402

from tpgraph.engine.limits import RequestLimits  # noqa: E402
from tpgraph.serve import http_options, parse_args  # noqa: E402
from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.options import HttpOptions  # noqa: E402

MODEL = "m"


def call(requests: list[tuple[str, str, dict | None]], http: HttpOptions | None = None, api_key: str | None = None,
         client=None) -> list:
    """[(method, path, headers)] -> the responses, in order, from one app."""
    httpx = httpx_module()
    app = server_app.create_app(client or IdleClient(), builtin_codec(MODEL), ServerMetrics(), MODEL, 128,
                                api_key=api_key, http=http)

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as web:
            return [await web.request(method, path, headers=headers or {}) for method, path, headers in requests]

    return asyncio.run(main())


def preflight(origin: str) -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_lets_any_origin_by_default_as_vllms_server_does():
    """A browser page on another origin asks first (a preflight OPTIONS, which carries no API key) and then reads the
    reply: both are answered with the CORS headers, the key's 401 too (else the page cannot read why it failed)."""
    pre, models, refused = call([("OPTIONS", "/v1/completions", preflight("http://page.example")),
                                 ("GET", "/v1/models", {"Origin": "http://page.example", "Authorization": "Bearer k"}),
                                 ("GET", "/v1/models", {"Origin": "http://page.example"})], api_key="k")
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_cors_allows_only_the_origins_methods_and_headers_given():
    http = http_options(parse_args(["--allowed-origins", '["https://ok.example"]', "--allowed-methods", '["GET"]',
                                    "--allowed-headers", '["content-type"]', "--allow-credentials"]))
    assert http == HttpOptions(("https://ok.example",), ("GET",), ("content-type",), True)
    ok, other, post, models = call([
        ("OPTIONS", "/v1/models", {"Origin": "https://ok.example", "Access-Control-Request-Method": "GET"}),
        ("OPTIONS", "/v1/models", {"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"}),
        ("OPTIONS", "/v1/completions", preflight("https://ok.example")),
        ("GET", "/v1/models", {"Origin": "https://ok.example"})], http)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert post.status_code == 400  # (POST and the authorization header are not allowed)
    assert models.headers["access-control-allow-origin"] == "https://ok.example"


@pytest.mark.parametrize("value", ["*", "https://ok.example", '{"a": 1}', "[1]"])
def test_cors_lists_are_json_lists_of_strings(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--allowed-origins", value])
    assert "argument --allowed-origins: must be a JSON list of strings" in capsys.readouterr().err


@contextlib.contextmanager
def frontend(http: HttpOptions):
    """The HTTP front end's own process (uvicorn, as the server starts it), with no engine behind it: its URL."""
    from tpgraph.server.frontend import FrontendSpec, start_frontend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = FrontendSpec("127.0.0.1", port, MODEL, 64, RequestLimits(258, 64, 256), builtin_codec(MODEL), http=http)
    proc, conn = start_frontend(spec)
    try:
        assert conn.poll(120) and conn.recv() == ("ready",)
        yield f"127.0.0.1:{port}"
        conn.send([("closing",)])
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        conn.close()


@pytest.mark.parametrize("flags,started,access", [
    ([], True, True),  # (vLLM's default, info: uvicorn says it runs, and logs each request)
    (["--uvicorn-log-level", "warning"], False, False),
    (["--disable-uvicorn-access-log"], True, False),
])
def test_uvicorns_log_level_and_access_log(flags, started, access, capfd):
    with frontend(http_options(parse_args(flags))) as address:
        with urllib.request.urlopen(f"http://{address}/version", timeout=30) as reply:
            assert reply.status == 200
    out = "".join(capfd.readouterr())
    assert ("Uvicorn running on" in out) == started, out
    assert ('"GET /version HTTP/1.1" 200' in out) == access, out
