"""vLLM's HTTP flags (server/options.py). In process (httpx over ASGI, no engine): CORS, --root-path, the API docs,
--response-role, --return-tokens-as-token-ids and the request log. In a front-end process of its own (uvicorn, no
engine): uvicorn's log level and access log, and HTTPS."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import IdleClient, ScriptedClient, builtin_codec, httpx_module, post_all, sse_events  # noqa: E402,E501

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
    from tpgraph.server.frontend import FrontendSpec, start_frontends
    from tpgraph.server.listeners import bind_sockets

    sockets = bind_sockets("127.0.0.1", 0, http.uds)
    port = 0 if http.uds is not None else sockets[0].getsockname()[1]
    spec = FrontendSpec("127.0.0.1", port, MODEL, 64, RequestLimits(258, 64, 256), builtin_codec(MODEL), http=http)
    [(proc, conn)] = start_frontends(spec, [sockets], None)
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


def test_vllms_keep_alive_timeout_closes_idle_connections(monkeypatch):
    """vLLM's uvicorn keeps an idle connection open VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds (5 where unset): raised past
    a load balancer's idle timeout, so that the balancer never reuses a connection the server is closing (a 502). The
    server kept uvicorn's 5 s whatever it said. At 1 s, an idle connection is closed within 2 s."""
    import time

    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "1")
    http = http_options(parse_args([]))
    assert http.keep_alive_s == 1
    with frontend(http) as address:
        host, port = address.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /version HTTP/1.1\r\nHost: t\r\n\r\n")
            reply = b""
            while not reply.endswith(b"}"):  # (the headers, then the JSON body)
                reply += sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert sock.recv(65536) == b""  # (the server closed it)
            assert time.monotonic() - started < 3


@pytest.mark.parametrize("value,needle", [("5s", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE='5s' must be a whole number"),
                                          ("-1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a whole number of seconds "
                                                 ">= 0, got -1")])
def test_a_keep_alive_timeout_that_is_no_count_of_seconds_is_refused(value, needle, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", value)
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_vllms_uds_serves_on_a_unix_socket(tmp_path):
    """vLLM's --uds serves the API on a Unix domain socket, in place of --host and --port (a sidecar or a local proxy
    reaches it without a port): refused here as a setting the server lacks."""
    import json

    path = str(tmp_path / "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:  # (a stopped server's socket file: taken over)
        stale.bind(path)
    http = http_options(parse_args(["--uds", path]))
    assert http.uds == path
    with frontend(http):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(path)
            sock.sendall(b"GET /version HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and "version" in json.loads(body)


def test_a_unix_socket_that_cannot_be_listened_on_is_refused_at_start_up(tmp_path, capsys):
    """As a port in use: said at once, before the model loads, not as the front end's failure after it."""
    from tpgraph.serve import main

    taken = tmp_path / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(taken))
        server.listen()
        assert main(["--device", "cpu", "--uds", str(taken)]) == 2
    assert f"cannot listen on --uds {taken}: a server listens on it already" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["--device", "cpu", "--uds", str(tmp_path / "file")]) == 2
    assert "it exists and is no socket" in capsys.readouterr().err
    assert main(["--device", "cpu", "--uds", str(tmp_path / "nowhere" / "api.sock")]) == 2
    assert "its directory does not exist" in capsys.readouterr().err
    from tpgraph.server.options import check_unix_socket

    check_unix_socket(str(taken))  # (its server gone: a stale socket file, which the server takes over)


def test_a_unix_socket_path_too_long_to_bind_is_refused_before_the_model_loads(tmp_path, capsys):
    """A socket path past the kernel's limit (108 bytes on Linux: a deep directory's) passed the start-up check and
    failed as the front end bound it, once the weights had loaded. The check binds it (and removes what it made)."""
    from tpgraph.serve import main
    from tpgraph.server.options import check_unix_socket

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert main(["--device", "cpu", "--uds", str(deep / "api.sock")]) == 2
    assert f"cannot listen on --uds {deep / 'api.sock'}: AF_UNIX path too long" in capsys.readouterr().err
    check_unix_socket(str(tmp_path / "api.sock"))
    assert not (tmp_path / "api.sock").exists()


def self_signed(tmp_path, name: str = "server"):
    """A certificate for 127.0.0.1 and its key, made with the openssl command (skipped without it)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def test_https_with_a_certificate_and_its_key(tmp_path):
    """--ssl-certfile and --ssl-keyfile: the server speaks TLS, with that certificate, and not plain HTTP."""
    import ssl
    import urllib.error

    key, cert = self_signed(tmp_path)
    http = http_options(parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]))
    assert http.scheme == "https"
    http.check_tls()
    with frontend(http) as address:
        trusting = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://{address}/version", timeout=30, context=trusting) as reply:
            assert reply.status == 200
        with pytest.raises(urllib.error.URLError):  # (the certificate is not one the default CAs vouch for)
            urllib.request.urlopen(f"https://{address}/version", timeout=30)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{address}/version", timeout=30)


def test_tls_files_that_cannot_serve_are_refused_at_start_up(tmp_path, capsys, monkeypatch):
    """A missing file, or a key that is not the certificate's, is said before the model loads (serve.main checks
    them on rank 0 beside the port), as are flags that do not go together."""
    from tpgraph.errors import ConfigError

    key, cert = self_signed(tmp_path)
    other_key, _ = self_signed(tmp_path, "other")
    with pytest.raises(ConfigError, match="cannot serve HTTPS with --ssl-certfile .*server.pem, --ssl-keyfile "
                                          ".*other.key: .*KEY_VALUES_MISMATCH"):
        HttpOptions(ssl_keyfile=str(other_key), ssl_certfile=str(cert)).check_tls()
    with pytest.raises(ConfigError, match="No such file"):
        HttpOptions(ssl_certfile=str(tmp_path / "missing.pem")).check_tls()
    from tpgraph.engine import tp_engine
    from tpgraph.serve import main

    def no_loading(**_):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tp_engine, "TPEngine", no_loading)
    monkeypatch.delenv("RANK", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--ssl-certfile", str(tmp_path / "missing.pem"), "--port", str(port)]) == 2
    assert "error: cannot serve HTTPS with --ssl-certfile" in capsys.readouterr().err
    for flags, needle in [(["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
                          (["--ssl-certfile", str(cert), "--ssl-cert-reqs", "2"], "checks client certificates against"),
                          (["--ssl-certfile", str(cert), "--ssl-cert-reqs", "5"], "--ssl-cert-reqs must be 0"),
                          (["--ssl-ca-certs", str(cert)], "are for HTTPS: give --ssl-certfile")]:
        with pytest.raises(SystemExit):
            parse_args(flags)
        assert needle in capsys.readouterr().err


def test_a_root_path_serves_the_api_under_a_proxys_prefix():
    """--root-path /llm: a proxy that passes the prefix on (/llm/v1/models) and one that strips it (/v1/models) both
    reach the routes; the key still leaves /health open under the prefix."""
    http = http_options(parse_args(["--root-path", "/llm"]))
    prefixed, stripped, health, guarded = call([("GET", "/llm/v1/models", None), ("GET", "/v1/models", None),
                                                ("GET", "/llm/health", None), ("GET", "/llm/v1/models", None)], http)
    assert prefixed.status_code == 200 and prefixed.json()["data"][0]["id"] == MODEL
    assert stripped.status_code == 200
    keyed = call([("GET", "/llm/health", None), ("GET", "/llm/v1/models", None)], http, api_key="k")
    assert [r.status_code for r in keyed] == [200, 401]
    assert call([("GET", "/llm/v1/models", None)])[0].status_code == 404  # (no root path: no such route)
    assert health.status_code == guarded.status_code == 200


@pytest.mark.parametrize("value", ["llm", "/llm/"])
def test_a_root_path_is_a_path_prefix(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--root-path", value])
    assert "--root-path must begin with / and not end with one" in capsys.readouterr().err


def test_the_response_role_names_a_chat_replys_role():
    """vLLM's --response-role: the role of a reply to a new turn (streamed: its first delta's); a reply that
    continues the last message (add_generation_prompt false) takes that message's role, as vLLM's does."""
    http = http_options(parse_args(["--response-role", "model"]))
    app = server_app.create_app(ScriptedClient(["hi"]), builtin_codec(MODEL), ServerMetrics(), MODEL, 128, http=http)
    ask = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    go_on = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The"}],
             "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    one, streamed, continued = post_all(app, [("/v1/chat/completions", ask),
                                              ("/v1/chat/completions", {**ask, "stream": True}),
                                              ("/v1/chat/completions", go_on)])
    assert one.json()["choices"][0]["message"] == {"role": "model", "content": "hi", **server_app.MESSAGE_NULLS}
    assert sse_events(streamed.text)[0]["choices"][0]["delta"]["role"] == "model"
    assert continued.json()["choices"][0]["message"]["role"] == "assistant"
    default = server_app.create_app(ScriptedClient(["hi"]), builtin_codec(MODEL), ServerMetrics(), MODEL, 128)
    assert post_all(default, [("/v1/chat/completions", ask)])[0].json()["choices"][0]["message"]["role"] == "assistant"


def test_tokens_as_token_ids_by_default_where_a_request_does_not_say():
    """vLLM's --return-tokens-as-token-ids: log-probability entries name tokens "token_id:N", unless the request's
    return_tokens_as_token_ids says otherwise (false, or true on a server without the flag)."""
    def tokens(http: HttpOptions, asked: dict) -> tuple[str, str]:
        app = server_app.create_app(ScriptedClient(["x"]), builtin_codec(MODEL), ServerMetrics(), MODEL, 128,
                                    http=http)
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, **asked}
        completion = {"prompt": "x", "max_tokens": 1, "logprobs": 0, **asked}
        got_chat, got_completion = post_all(app, [("/v1/chat/completions", chat), ("/v1/completions", completion)])
        return (got_chat.json()["choices"][0]["logprobs"]["content"][0]["token"],
                got_completion.json()["choices"][0]["logprobs"]["tokens"][0])

    on = http_options(parse_args(["--return-tokens-as-token-ids"]))
    assert tokens(on, {}) == ("token_id:7", "token_id:7")
    assert tokens(on, {"return_tokens_as_token_ids": None}) == ("token_id:7", "token_id:7")
    assert tokens(on, {"return_tokens_as_token_ids": False}) == ("\x07", "\x07")
    assert tokens(HttpOptions(), {}) == ("\x07", "\x07")
    assert tokens(HttpOptions(), {"return_tokens_as_token_ids": True}) == ("token_id:7", "token_id:7")


def test_the_api_docs_are_served_unless_disabled():
    """As vLLM's server: the OpenAPI schema, Swagger UI and ReDoc; --disable-fastapi-docs serves none of them. Behind
    --root-path, the schema names the prefix (its servers), so the pages call the API through the proxy."""
    pages = [("GET", path, None) for path in ("/openapi.json", "/docs", "/redoc")]
    schema, swagger, redoc = call(pages, http_options(parse_args(["--root-path", "/llm"])))
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert schema.json()["servers"] == [{"url": "/llm"}]
    assert swagger.status_code == redoc.status_code == 200 and "openapi.json" in swagger.text
    off = call(pages, http_options(parse_args(["--disable-fastapi-docs"])))
    assert [r.status_code for r in off] == [404, 404, 404]
    # with --api-key they stay open, as vLLM leaves them (Swagger UI's page cannot send the key); the API does not
    keyed = call([*pages, ("GET", "/v1/models", None)], http_options(parse_args([])), api_key="k")
    assert [r.status_code for r in keyed] == [200, 200, 200, 401]


def test_each_operation_of_the_api_schema_has_its_own_id():
    """OpenAPI asks that every operation's operationId be unique (a client generator names its methods by them):
    /ping's GET and POST, one route of two methods, shared one, ping_ping_post, and FastAPI warned of it each time
    the schema was built."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (FastAPI's "Duplicate Operation ID" warning)
        (schema,) = call([("GET", "/openapi.json", None)])
    ids = [op["operationId"] for path in schema.json()["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))
    assert {"get", "post"} <= set(schema.json()["paths"]["/ping"])


def test_requests_are_logged_with_their_prompt_and_parameters_where_asked(caplog):
    """vLLM's --enable-log-requests (off by default, and --disable-log-requests keeps it off): a line for each
    request, its prompt cut to --max-log-len characters or ids, and its parameters."""
    import logging

    assert not http_options(parse_args([])).log_requests
    assert not http_options(parse_args(["--enable-log-requests", "--disable-log-requests"])).log_requests
    body = {"prompt": "hello", "max_tokens": 1, "temperature": 0.5}
    for flags, logged in [([], None), (["--enable-log-requests"], "prompt: 'hello', "),
                          (["--enable-log-requests", "--max-log-len", "3"], "prompt: 'hel', ")]:
        app = server_app.create_app(ScriptedClient(["x"]), builtin_codec(MODEL), ServerMetrics(), MODEL, 128,
                                    http=http_options(parse_args(flags)))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tpgraph.server.app"):
            (reply,) = post_all(app, [("/v1/completions", body)])
        assert reply.status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
        if logged is None:
            assert lines == []
            continue
        (line,) = lines
        assert logged in line and "temperature=0.5" in line and "max_tokens=1" in line
        ids = builtin_codec(MODEL).encode_text("hello")
        assert line.endswith(f"prompt_token_ids: {ids if '3' not in flags else ids[:3]}")


def test_the_request_log_names_each_request_by_its_replys_id(caplog):
    """vLLM's --enable-log-requests line names a request by the id its reply carries (cmpl-<id>-<prompt index>,
    chatcmpl-<id>, ...: the client's X-Request-Id, or the body's request_id), so that an operator finds a client's
    request in the log. It named an id of the engine's own (req-<hex>), which no reply, header or other log line
    carried."""
    import logging

    app = server_app.create_app(ScriptedClient(["x"]), builtin_codec(MODEL), ServerMetrics(), MODEL, 128,
                                http=http_options(parse_args(["--enable-log-requests"])))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with caplog.at_level(logging.INFO, logger="tpgraph.server.app"):
        replies = [*post_all(app, [("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}),
                                   ("/v1/chat/completions", chat)], headers={"X-Request-Id": "abc"}),
                   *post_all(app, [("/v1/chat/completions", {**chat, "request_id": "def"}),
                                   ("/v1/messages", {**chat, "model": MODEL}),
                                   ("/v1/responses", {"input": "hi", "max_output_tokens": 1})])]
    assert [r.status_code for r in replies] == [200] * 5, [r.text for r in replies]
    logged = [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("Received request")]
    assert logged == ["Received request cmpl-abc-0", "Received request cmpl-abc-1", "Received request chatcmpl-abc",
                      "Received request chatcmpl-def", f"Received request {replies[3].json()['id']}",
                      f"Received request {replies[4].json()['id']}"]


def test_the_request_log_says_when_a_request_is_aborted(caplog):
    """vLLM's --enable-log-requests also logs "Aborted request(s) ..." where a request is aborted (its client went
    away): the log said a request was received and never what became of it. Two prompts of a completion whose client
    leaves while they decode."""
    import logging
    import time

    from tpgtest.server_stubs import EndlessClient

    from tpgraph.engine.sampling_params import SamplingParams

    class Leaving:  # (a client that goes away 0.2 s after its request)
        start = time.monotonic()

        async def is_disconnected(self) -> bool:
            return time.monotonic() - self.start > 0.2

    client = EndlessClient()
    api = server_app.Api(client, ServerMetrics(), MODEL, HttpOptions(log_requests=True))

    async def main() -> None:
        async for _ in api.run(Leaving(), [[1], [2]], SamplingParams(max_tokens=100), names=["cmpl-x-0", "cmpl-x-1"]):
            pass
        for task in client.tasks:
            task.cancel()

    with caplog.at_level(logging.INFO, logger="tpgraph.server.app"):
        asyncio.run(main())
    assert len(client.aborted) == 2
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Aborted")] == [
        "Aborted request(s) cmpl-x-0,cmpl-x-1."]


@pytest.mark.parametrize("field, value", [("allowed_origins", ["*"]), ("allowed_methods", ("GET", 1)),
                                          ("allow_credentials", "yes")])
def test_cors_settings_of_the_wrong_type_are_refused_without_https_too(field, value):
    """HttpOptions made in code (not through the flags): the CORS fields' checks sat after check_tls's no-HTTPS return,
    so over plain HTTP a list or a truthy string went to the middleware unchecked."""
    from tpgraph.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^{field} must be"):
        HttpOptions(**{field: value})


def test_default_chat_template_kwargs_flag_reaches_the_options(capsys):
    http = http_options(parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false}']))
    assert http.default_chat_template_kwargs == {"enable_thinking": False}
    assert http.template_variables({"x": 1}) == {"enable_thinking": False, "x": 1}
    assert http_options(parse_args([])).template_variables(None) is None
    with pytest.raises(SystemExit):
        parse_args(["--default-chat-template-kwargs", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_force_include_usage_gives_every_stream_its_usage(path):
    """vLLM's --enable-force-include-usage: every stream reports usage as if it asked for include_usage and
    continuous_usage_stats (each chunk its usage so far, then a usage chunk with no choices). The flag was refused
    as unknown, so a vLLM launch command that gives it did not start."""
    forced = http_options(parse_args(["--enable-force-include-usage"]))
    assert not http_options(parse_args([])).force_include_usage
    app = server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(MODEL), ServerMetrics(), MODEL, 128,
                                http=forced)
    body = {"max_tokens": 2, "stream": True,
            **({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})}
    (streamed,) = post_all(app, [(path, body)])
    chunks = sse_events(streamed.text)
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_trust_request_chat_template_renders_a_requests_own_template():
    """vLLM's --trust-request-chat-template: a request's chat_template renders its chat, on /v1/chat/completions and
    /tokenize alike (in the same sandbox, with the checkpoint's special tokens). The flag was refused as unknown, so a
    vLLM launch command that gives it did not start, and such a request was a 400 whatever the server's setting;
    without the flag it is still refused, as vLLM's, and chat_template_kwargs' chat_template always is."""
    trusted = http_options(parse_args(["--trust-request-chat-template"]))
    assert trusted.trust_request_chat_template and not http_options(parse_args([])).trust_request_chat_template
    codec, client = builtin_codec(), ScriptedClient(["x"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128, http=trusted)
    own = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[bot]"
    messages = [{"role": "user", "content": "hi"}]
    chat, counted, bad, in_kwargs, empty = post_all(app, [
        ("/v1/chat/completions", {"model": "m", "messages": messages, "chat_template": own, "max_tokens": 1}),
        ("/tokenize", {"messages": messages, "chat_template": own}),
        ("/tokenize", {"messages": messages, "chat_template": "{% for %}"}),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"chat_template": own}}),
        ("/tokenize", {"messages": messages, "chat_template": ""})])  # (as vLLM's `or`: the server's own)
    assert empty.json()["tokens"] == codec.encode_text(codec.render_chat(messages), add_special_tokens=False)
    assert chat.status_code == counted.status_code == 200, (chat.text, counted.text)
    ids = codec.encode_text("<|begin_of_text|>[user] hi\n[bot]", add_special_tokens=False)
    assert client.prompts == [ids] and counted.json()["tokens"] == ids
    assert bad.status_code == 400 and "chat_template: the chat template does not parse" in bad.text
    assert in_kwargs.status_code == 400 and "send it as the request's chat_template" in in_kwargs.text
    refused, = post_all(server_app.create_app(ScriptedClient(["x"]), codec, ServerMetrics(), "m", 128), [
        ("/v1/chat/completions", {"model": "m", "messages": messages, "chat_template": own})])
    assert refused.status_code == 400 and "--trust-request-chat-template" in refused.json()["error"]["message"]


def test_a_unix_socket_whose_server_cannot_be_told_gone_is_not_taken_over(tmp_path):
    """Only a refused connection says the socket's server is gone: uvicorn (asyncio) deletes the socket file it takes
    over, so a live datagram server's socket (its connect fails otherwise) must be refused, not taken."""
    from tpgraph.errors import ConfigError
    from tpgraph.server.listeners import bind_sockets

    path = str(tmp_path / "dgram.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as live:
        live.bind(path)
        with pytest.raises(ConfigError, match="cannot listen on --uds .*: its server cannot be told gone"):
            bind_sockets("127.0.0.1", 8000, path)


def test_a_unix_socket_a_server_took_while_the_model_loaded_is_not_taken_over(tmp_path):
    """rank 0 checks --uds before minutes of loading, and binds it as the front ends start; a server that began
    listening there since would lose its socket to a take-over (asyncio deletes the file), so the bind checks again
    and refuses, and the live server keeps its socket. A stopped server's socket file is taken over."""
    from tpgraph.errors import ConfigError
    from tpgraph.server.listeners import bind_sockets, close_sockets

    path = str(tmp_path / "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(path)
        live.listen()
        with pytest.raises(ConfigError, match="a server listens on it already"):
            bind_sockets("127.0.0.1", 8000, path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)  # (still the live server's socket)
            accepted, _ = live.accept()
            accepted.close()
    ours = bind_sockets("127.0.0.1", 8000, path)  # (its server gone: taken over)
    try:
        assert [sock.getsockname() for sock in ours] == [path]
    finally:
        close_sockets(ours)


def test_a_requests_own_chat_template_is_compiled_once_not_per_request(monkeypatch):
    """Compiling a chat template takes tens of milliseconds, on the event loop: a client sending the same
    chat_template with every request (as one does under --trust-request-chat-template) stalled every stream that long
    per request. It is compiled once, as transformers' compile cache does under vLLM."""
    from tpgraph.server import protocol

    compiled = []
    real = protocol.ChatTemplate
    monkeypatch.setattr(protocol, "ChatTemplate", lambda *a, **k: compiled.append(a) or real(*a, **k))
    own = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[once]"
    tokens = {"bos_token": "<s>"}
    first = protocol.request_template(own, None, True, tokens)
    assert protocol.request_template(own, None, True, dict(tokens)) is first and len(compiled) <= 1
    assert protocol.request_template(own, None, True, {"bos_token": "<b>"}).special_tokens == {"bos_token": "<b>"}


def test_a_log_config_file_for_uvicorn_leaves_the_servers_own_logging(tmp_path, monkeypatch, capfd):
    """vLLM's --log-config-file is uvicorn's log_config (its server's own logging is VLLM_LOGGING_CONFIG_PATH's, or
    its default): a file that formats uvicorn's access lines alone, as such files do, took the server's own logging's
    place, so the server's lines (the stats line, "serving on", ...) below WARNING were lost."""
    import json

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    path = tmp_path / "uvicorn.json"
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False, "formatters": {"a": {"format": "ACCESS %(message)s"}},
        "handlers": {"a": {"class": "logging.StreamHandler", "formatter": "a"}},
        "loggers": {"uvicorn.access": {"handlers": ["a"], "level": "INFO", "propagate": False}}}))
    with frontend(http_options(parse_args(["--log-config-file", str(path)]))) as address:
        with urllib.request.urlopen(f"http://{address}/version", timeout=30) as reply:
            assert reply.status == 200
    out = "".join(capfd.readouterr())
    assert 'ACCESS 127.0.0.1' in out and '"GET /version HTTP/1.1" 200' in out, out
    assert "INFO tpgraph.serve: the engine is stopping" in out, out


def test_several_front_ends_get_a_socket_each_that_the_kernel_spreads_connections_over():
    """One listening socket shared by several front ends let the one that woke first accept a whole burst (asyncio
    takes up to its backlog at a wake-up): each gets its own, SO_REUSEPORT, and the kernel spreads connections over
    them. Before they are bound, the port is checked as a lone server's: a server listening there, even one with
    SO_REUSEPORT (another of ours), is refused, not joined."""
    from tpgraph.errors import ConfigError
    from tpgraph.server.listeners import close_sockets, front_end_sockets

    copies = front_end_sockets("127.0.0.1", 0, None, 4)
    port = copies[0][0].getsockname()[1]
    clients: list[socket.socket] = []
    try:
        assert len({id(each[0]) for each in copies}) == 4
        assert {each[0].getsockname()[1] for each in copies} == {port}  # (port 0: the kernel's choice, for all)
        for each in copies:
            each[0].listen()
        counts = [0] * 4
        clients += [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        for i, each in enumerate(copies):
            each[0].setblocking(False)
            while True:
                try:
                    accepted, _ = each[0].accept()
                except BlockingIOError:
                    break
                accepted.close()
                counts[i] += 1
        assert sum(counts) == 64 and min(counts) > 0, counts  # (hashed: each gets some; P(one gets none) ~ 1e-8)
        with pytest.raises(ConfigError, match="Address already in use"):
            front_end_sockets("127.0.0.1", port, None, 2)
    finally:
        for client in clients:
            client.close()
        close_sockets([sock for each in copies for sock in each])


def test_a_unix_socket_may_be_reached_by_other_users_as_uvicorns_is(tmp_path):
    """uvicorn made its --uds socket file 0o666 (a stale one's mode kept): a proxy running as another user (nginx's
    www-data) connects. rank 0 binds it now, and the umask's 0o755 left every other user refused."""
    import os
    import stat

    from tpgraph.server.listeners import bind_sockets, close_sockets

    path = tmp_path / "api.sock"
    ours = bind_sockets("127.0.0.1", 8000, str(path))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    finally:
        close_sockets(ours)
    os.chmod(path, 0o660)  # (a stale socket's mode, chosen by its owner, is kept as the file is taken over)
    ours = bind_sockets("127.0.0.1", 8000, str(path))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    finally:
        close_sockets(ours)


def test_https_with_several_front_ends_relays_the_responses_api_to_the_first(tmp_path):
    """With --api-server-count, front ends but the first relay /v1/responses to front end 0's private Unix socket in
    plain HTTP; front end 0 served that socket with the certificate too, so every relayed request was a 503 under
    HTTPS. The private socket speaks plain HTTP (the client's TLS ended at the front end it reached)."""
    import ssl
    import tempfile

    from tpgraph.server.frontend import FrontendSpec, start_frontends
    from tpgraph.server.listeners import front_end_sockets

    key, cert = self_signed(tmp_path)
    http = http_options(parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]))
    sockets = front_end_sockets("127.0.0.1", 0, None, 2)
    port = sockets[0][0].getsockname()[1]
    spec = FrontendSpec("127.0.0.1", port, MODEL, 64, RequestLimits(258, 64, 256), builtin_codec(MODEL), http=http)
    with tempfile.TemporaryDirectory(prefix="tpg-") as scratch:
        fronts = start_frontends(spec, sockets, scratch)
        try:
            for _, conn in fronts:
                assert conn.poll(120) and conn.recv() == ("ready",)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # (as the relay reaches front end 0)
                sock.settimeout(10)
                sock.connect(f"{scratch}/responses.sock")
                sock.sendall(b"GET /v1/responses/resp_x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
            trusting = ssl.create_default_context(cafile=str(cert))
            statuses = set()
            for _ in range(16):  # (a connection each, which the kernel hands to either: P(front end 1 none) ~ 2e-5)
                try:
                    urllib.request.urlopen(f"https://127.0.0.1:{port}/v1/responses/resp_x", timeout=10,
                                           context=trusting)
                except urllib.error.HTTPError as exc:
                    statuses.add(exc.code)
            assert statuses == {404}
        finally:
            for _, conn in fronts:
                conn.send([("closing",)])
            for proc, conn in fronts:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                conn.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_another_server_sharing_the_port_with_so_reuseport_is_found(host):
    """A second server with several front ends started on the port while the first loaded (neither listening yet:
    SO_REUSEADDR lets both bind) joins the first's SO_REUSEPORT sockets as they listen, and the kernel splits the
    connections between the two servers. ListenPoints finds the other's listening sockets; ours alone, none."""
    from tpgraph.server.listeners import ListenPoints, close_sockets, front_end_sockets

    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    ours = front_end_sockets(host, 0, None, 2)
    port = ours[0][0].getsockname()[1]
    points = ListenPoints([sock for each in ours for sock in each])
    theirs = front_end_sockets(host, port, None, 2)  # (ours bound, not listening: its lone check passes)
    try:
        for each in ours:
            each[0].listen()
        assert points.others() == []
        for each in theirs:
            each[0].listen()
        assert points.others() == [f"{host}:{port}"]
    finally:
        close_sockets([sock for each in ours + theirs for sock in each])


def test_another_server_on_one_address_of_a_port_we_serve_on_every_interface_is_found():
    """Ours on every interface (--host ""): another's SO_REUSEPORT socket on 127.0.0.1 of that port takes every
    connection to 127.0.0.1 (the kernel prefers the more specific address)."""
    from tpgraph.server.listeners import ListenPoints, close_sockets, front_end_sockets

    ours = front_end_sockets("", 0, None, 2)
    port = ours[0][0].getsockname()[1]
    points = ListenPoints([sock for each in ours for sock in each])
    theirs = front_end_sockets("127.0.0.1", port, None, 2)
    try:
        for sock in (*ours[0], *ours[1], theirs[0][0]):
            sock.listen()
        assert points.others() == [f"127.0.0.1:{port}"]
    finally:
        close_sockets([sock for each in ours + theirs for sock in each])


def test_a_temporary_directory_too_deep_for_the_relay_socket_is_refused_before_the_model_loads(tmp_path, capsys,
                                                                                              monkeypatch):
    """Several front ends share a directory under TMPDIR, front end 0's Unix socket for the Responses API relay in it:
    a TMPDIR deep enough to pass the kernel's 108 bytes stopped the server once the weights had loaded, minutes in."""
    import tempfile

    from tpgraph.engine import tp_engine
    from tpgraph.serve import main

    def no_loading(**_):
        raise AssertionError("the model was loaded")

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # (read again from TMPDIR)
    monkeypatch.setattr(tp_engine, "TPEngine", no_loading)
    monkeypatch.delenv("RANK", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--device", "cpu", "--port", str(port), "--api-server-count", "2"]) == 2
    assert "cannot make the front ends' private socket" in capsys.readouterr().err
    assert list(deep.iterdir()) == []  # (the shared directory made for the check is removed)
    with socket.socket() as s:  # (the port's sockets closed)
        s.bind(("127.0.0.1", port))
