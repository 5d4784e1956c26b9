"""Several front ends: those but front end 0 relay the Responses API's requests to it over a Unix socket (relay.py).
Both ends are real uvicorn servers on Unix sockets, on the test's loop: a relaying app (create_app with relay_uds) and,
as front end 0, a stand-in that echoes what reached it, streams, or waits for its client to go (or the real app)."""

import asyncio
import contextlib
import json
import shutil
import socket
import tempfile

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from tpgtest.server_stubs import IdleClient, ScriptedClient, builtin_codec, httpx_module  # noqa: E402

from tpgraph.server.app import create_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.options import HttpOptions  # noqa: E402
from tpgraph.server.relay import is_responses_path  # noqa: E402

httpx = httpx_module()
TIMEOUT_S = 3


class Upstream:
    """Front end 0's stand-in, as raw ASGI: notes each request; /v1/responses/stream sends an event, waits for go_on,
    sends another; /v1/responses/left sends an event and /v1/responses/held nothing, each then waiting for its client
    to go (gone, also set where the client goes before its body's end); /v1/responses/broken sends an event and
    fails; any other path echoes the request as JSON, with a 201 and headers of its own."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.go_on, self.holding, self.gone = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.arrived = asyncio.Event()  # (a request, before its body is read)

    async def __call__(self, scope, receive, send) -> None:
        assert scope["type"] == "http"
        self.arrived.set()
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # (the relayed request closed before its body's end)
                self.gone.set()
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append({"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                          "headers": {k.decode(): v.decode() for k, v in scope["headers"]}, "body": body})
        if scope["path"] in ("/v1/responses/stream", "/v1/responses/left", "/v1/responses/broken"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"x-upstream", b"stream")]})
            await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
            if scope["path"] == "/v1/responses/broken":
                raise RuntimeError("front end 0 failed mid-stream")
            if scope["path"] == "/v1/responses/stream":
                await self.go_on.wait()
                await send({"type": "http.response.body", "body": b"data: two\n\n"})
                return
        if scope["path"] in ("/v1/responses/held", "/v1/responses/left"):
            self.holding.set()
            if (await receive())["type"] == "http.disconnect":
                self.gone.set()
            return
        echoed = json.dumps({"method": scope["method"], "length": len(body)}).encode()
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json"), (b"x-upstream", b"yes"),
                                (b"content-length", str(len(echoed)).encode())]})
        await send({"type": "http.response.body", "body": echoed})


@contextlib.asynccontextmanager
async def served(app, uds: str):
    """uvicorn serving `app` on the Unix socket `uds`, on this loop, until the block ends."""
    server = uvicorn.Server(uvicorn.Config(app, uds=uds, log_config=None, timeout_graceful_shutdown=1))
    server.capture_signals = contextlib.nullcontext  # (pytest's own signal handlers stay)
    task = asyncio.create_task(server.serve())
    while not server.started:  # (serve() ends at once where it cannot start: its error is raised here)
        if task.done():
            task.result()
            raise AssertionError("uvicorn did not start")
        await asyncio.sleep(0.005)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


def relaying_app(relay_uds: str, **kw):
    return create_app(IdleClient(), builtin_codec(), ServerMetrics(), "m", 128, relay_uds=relay_uds, **kw)


@pytest.fixture
def sockets():
    """Two Unix socket paths: front end 0's and the relaying front end's (short: AF_UNIX takes ~100 bytes)."""
    folder = tempfile.mkdtemp(prefix="relay")
    yield f"{folder}/front0.sock", f"{folder}/front1.sock"
    shutil.rmtree(folder, ignore_errors=True)


def relayed(sockets, test, upstream_app=None, **app_kw) -> None:
    """Runs test(http client of the relaying front end, upstream) with both front ends served."""
    upstream = Upstream() if upstream_app is None else upstream_app
    up, front = sockets

    async def main() -> None:
        async with served(upstream, up), served(relaying_app(up, **app_kw), front):
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=front), base_url="http://t",
                                         timeout=TIMEOUT_S) as http:
                await test(http, upstream)

    asyncio.run(asyncio.wait_for(main(), 4 * TIMEOUT_S))


def test_the_responses_path_is_the_path_and_below_it_only():
    assert is_responses_path("/v1/responses") and is_responses_path("/v1/responses/resp_1/cancel")
    assert not is_responses_path("/v1/responsesX") and not is_responses_path("/v1/response")
    assert not is_responses_path("/v1/chat/completions") and not is_responses_path("/x/v1/responses")


def test_a_post_goes_on_whole_with_its_query_and_end_to_end_headers(sockets):
    body = b"x" * 300_000  # (more than one chunk each way)

    async def test(http, upstream: Upstream) -> None:
        reply = await http.post("/v1/responses?a=1&b=%20x", content=body, headers={
            "Authorization": "Bearer k3y", "X-Request-Id": "rid-1", "Content-Type": "application/json",
            "Connection": "keep-alive, x-hop", "x-hop": "this connection's only", "Proxy-Authorization": "Basic p"})
        assert reply.status_code == 201 and reply.json() == {"method": "POST", "length": len(body)}
        assert reply.headers["x-upstream"] == "yes" and reply.headers["content-type"] == "application/json"
        assert reply.headers.get_list("server") == ["uvicorn"]  # (the relaying server's own, once)
        (seen,) = upstream.seen
        assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/v1/responses",
                                                                               "a=1&b=%20x", body)
        headers = seen["headers"]
        assert (headers["authorization"], headers["x-request-id"], headers["content-type"]) == (
            "Bearer k3y", "rid-1", "application/json")
        assert "x-hop" not in headers and "proxy-authorization" not in headers

    relayed(sockets, test)


def test_a_get_a_delete_and_a_chunked_body_go_on(sockets):
    async def chunks():
        yield b'{"a": '
        yield b"1}"

    async def test(http, upstream: Upstream) -> None:
        got = await http.get("/v1/responses/resp_1/input_items", params={"limit": "2", "order": "asc"})
        deleted = await http.delete("/v1/responses/resp_1")
        posted = await http.post("/v1/responses/resp_1/cancel", content=chunks())  # (Transfer-Encoding: chunked)
        assert [r.status_code for r in (got, deleted, posted)] == [201, 201, 201]
        assert [(s["method"], s["path"], s["query"], s["body"]) for s in upstream.seen] == [
            ("GET", "/v1/responses/resp_1/input_items", "limit=2&order=asc", b""),
            ("DELETE", "/v1/responses/resp_1", "", b""),
            ("POST", "/v1/responses/resp_1/cancel", "", b'{"a": 1}')]

    relayed(sockets, test)


def test_an_event_stream_comes_back_as_each_event_comes(sockets):
    async def test(http, upstream: Upstream) -> None:
        async with http.stream("GET", "/v1/responses/stream") as reply:
            assert reply.status_code == 200 and reply.headers["x-upstream"] == "stream"
            assert reply.headers["content-type"] == "text/event-stream"
            chunks = reply.aiter_raw()
            # the first event arrives while front end 0 still holds back the second
            assert await asyncio.wait_for(anext(chunks), TIMEOUT_S) == b"data: one\n\n"
            assert not upstream.go_on.is_set()
            upstream.go_on.set()
            assert b"".join([c async for c in chunks]) == b"data: two\n\n"

    relayed(sockets, test)


def test_a_client_that_leaves_mid_stream_closes_the_relayed_request(sockets):
    async def test(http, upstream: Upstream) -> None:
        async with http.stream("GET", "/v1/responses/left") as reply:
            assert await asyncio.wait_for(anext(reply.aiter_raw()), TIMEOUT_S) == b"data: one\n\n"
        assert not upstream.gone.is_set()
        await asyncio.wait_for(upstream.gone.wait(), TIMEOUT_S)  # (front end 0 hears its client go)

    relayed(sockets, test)


def test_a_client_that_leaves_before_the_reply_begins_closes_the_relayed_request(sockets):
    """A whole (not streamed) answer is long in coming: its client gives up, and front end 0 must hear it to abort."""
    async def test(http, upstream: Upstream) -> None:
        waiting = asyncio.create_task(http.post("/v1/responses/held", json={"input": "x"}))
        await asyncio.wait_for(upstream.holding.wait(), TIMEOUT_S)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(upstream.gone.wait(), TIMEOUT_S)

    relayed(sockets, test)


def test_a_stream_that_front_end_0_breaks_off_is_cut_not_ended(sockets):
    """The client must not take a stream cut short for a whole one: its connection is closed mid-body."""
    async def test(http, _) -> None:
        async with http.stream("GET", "/v1/responses/broken") as reply:
            chunks = reply.aiter_raw()
            assert await anext(chunks) == b"data: one\n\n"
            with pytest.raises(httpx.RemoteProtocolError):
                await anext(chunks)

    relayed(sockets, test)


def test_a_client_that_leaves_mid_body_closes_the_relayed_request(sockets, caplog):
    async def test(_, upstream: Upstream) -> None:
        reader, writer = await asyncio.open_unix_connection(sockets[1])
        writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        await writer.drain()
        await asyncio.wait_for(upstream.arrived.wait(), TIMEOUT_S)  # (the relayed request is under way)
        writer.close()
        await asyncio.wait_for(upstream.gone.wait(), TIMEOUT_S)
        assert upstream.seen == []

    relayed(sockets, test)
    assert "Exception in ASGI application" not in caplog.text


def test_other_paths_are_served_here(sockets):
    async def test(http, upstream: Upstream) -> None:
        models = await http.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
        near = await http.post("/v1/responsesX", json={})
        assert near.status_code == 404 and near.json()["error"]["type"] == "NotFoundError"
        assert upstream.seen == []

    relayed(sockets, test)


def test_a_root_path_prefix_goes_on_as_the_client_sent_it(sockets):
    async def test(http, upstream: Upstream) -> None:
        assert (await http.get("/llm/v1/responses/resp_1")).status_code == 201
        assert (await http.get("/v1/responses/resp_2")).status_code == 201
        assert (await http.get("/llm/v1/models")).status_code == 200
        assert [s["path"] for s in upstream.seen] == ["/llm/v1/responses/resp_1", "/v1/responses/resp_2"]

    relayed(sockets, test, http=HttpOptions(root_path="/llm"))


def test_a_front_end_0_that_cannot_be_reached_is_a_503_that_says_why(sockets):
    up, _ = sockets  # (nothing listens there)

    async def main():
        app = relaying_app(up)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.post("/v1/responses", json={"input": "x"}), await http.get("/v1/models")

    refused, models = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert "front end 0" in error["message"] and "cannot be reached" in error["message"]
    assert models.status_code == 200  # (the rest is served as ever)


class Frontend0Client(ScriptedClient):
    def attach(self, loop) -> None:  # (uvicorn runs the app's lifespan)
        pass


def test_a_response_stored_through_the_relay_is_read_back_through_it(sockets):
    """Front end 0 is the real app, which alone checks the key: the relaying one has none set."""
    front0 = create_app(Frontend0Client(["Hel", "lo"]), builtin_codec(), ServerMetrics(), "m", 128, api_key="k3y",
                        request_id_headers=True)
    key = {"Authorization": "Bearer k3y"}

    async def test(http, _) -> None:
        assert (await http.post("/v1/responses", json={"model": "m", "input": "Hi"})).status_code == 401
        created = await http.post("/v1/responses", json={"model": "m", "input": "Hi", "store": True},
                                  headers={**key, "X-Request-Id": "resp_abc"})
        assert created.status_code == 200, created.text
        assert created.headers["x-request-id"] == "resp_abc"  # (front end 0's header, passed back)
        response = created.json()
        assert response["id"] == "resp_abc" and response["output"][0]["content"][0]["text"] == "Hello"
        read = await http.get("/v1/responses/resp_abc", headers=key)
        assert read.status_code == 200 and read.json() == response
        items = await http.get("/v1/responses/resp_abc/input_items", headers=key)
        assert [item["content"] for item in items.json()["data"]] == [[{"type": "input_text", "text": "Hi"}]]
        async with http.stream("POST", "/v1/responses", headers=key,
                               json={"model": "m", "input": "Hi", "stream": True}) as streamed:
            text = (await streamed.aread()).decode()
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert "event: response.completed" in text and '"delta":"Hel"' in text.replace(" ", "")
        assert (await http.delete("/v1/responses/resp_abc", headers=key)).status_code == 200
        assert (await http.get("/v1/responses/resp_abc", headers=key)).status_code == 404

    relayed(sockets, test, upstream_app=front0)


def test_a_front_end_but_the_first_relays_to_the_first(sockets):
    """run_frontend: a FrontendSpec of index > 0 relays to its responses_uds (front end 0 there: the stand-in)."""
    from tpgraph.engine.limits import RequestLimits
    from tpgraph.server.frontend import FrontendSpec, start_frontend
    from tpgraph.server.listeners import bind_sockets, close_sockets

    up, front = sockets
    spec = FrontendSpec("127.0.0.1", 0, "m", 64, RequestLimits(vocab_size=100, max_model_len=64, cache_tokens=256),
                        builtin_codec(), http=HttpOptions(uds=front), index=1, count=2, responses_uds=up)
    listening = bind_sockets("127.0.0.1", 0, front)
    proc, conn = start_frontend(spec, listening)
    close_sockets(listening)
    upstream = Upstream()

    async def main() -> tuple:
        async with served(upstream, up), httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=front),
                                                           base_url="http://t", timeout=TIMEOUT_S) as http:
            return (await http.get("/v1/responses/resp_1")).status_code, (await http.get("/v1/models")).status_code

    try:
        assert conn.poll(60) and conn.recv() == ("ready",)
        assert asyncio.run(asyncio.wait_for(main(), TIMEOUT_S)) == (201, 200)
        assert [s["path"] for s in upstream.seen] == ["/v1/responses/resp_1"]
    finally:
        conn.send([("closing",)])
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        conn.close()


def test_front_end_0s_relay_socket_listens_before_front_end_0_serves(tmp_path, monkeypatch):
    """The other front ends may serve before front end 0 does (the kernel hands connections to whichever listens):
    a Responses API request they relayed to front end 0's socket, bound but not yet listening, was refused, a 503.
    It listens as it is handed over, so such a request waits in its backlog for front end 0."""
    from tpgraph.engine.limits import RequestLimits
    from tpgraph.server import frontend
    from tpgraph.server.listeners import front_end_sockets

    handed = {}
    monkeypatch.setattr(frontend, "start_frontend", lambda spec, sockets, private=None: handed.setdefault(
        spec.index, (private, private is not None and private.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))))
    spec = frontend.FrontendSpec("127.0.0.1", 0, "m", 64, RequestLimits(vocab_size=100, max_model_len=64,
                                                                        cache_tokens=256), builtin_codec())
    frontend.start_frontends(spec, front_end_sockets("127.0.0.1", 0, None, 2), str(tmp_path))
    assert handed[0][1] == 1 and handed[1] == (None, False)
