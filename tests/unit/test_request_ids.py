"""X-Request-Id and include_reasoning at their edges (helper-90: the empty-header and non-ASCII cases failed before
their mend): raw ASGI requests with exact header bytes, disconnects through the middleware, tool calls and cut
thoughts without reasoning."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import (  # noqa: E402
    EndlessClient,
    ScriptedClient,
    asgi_scope,
    builtin_codec,
    leave_mid_request,
    post_all,
    sse_events,
)

from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS  # noqa: E402
from tpgraph.server.tools import ToolOptions  # noqa: E402

CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def call(app, path: str, body: dict, headers: list[tuple[bytes, bytes]]) -> tuple[dict, bytes]:
    """One request over raw ASGI (exact header bytes); the response start message and the body."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(asgi_scope(path, headers), receive, send), 10))
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def response_ids(start: dict) -> list[bytes]:
    return [v for n, v in start["headers"] if n.lower() == b"x-request-id"]


def app_with_ids(**kw):
    return server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(), ServerMetrics(), "m", 128,
                                 request_id_headers=True, **kw)


@pytest.mark.parametrize("sent", [
    [(b"x-request-id", b"")],  # an empty header
    [(b"x-request-id", b""), (b"x-request-id", b"trace-9")],  # an empty one, then a real one
])
def test_the_body_names_the_id_the_header_returns(sent):
    """The commit says: every response carries the header, 'the same id the reply's body names'."""
    start, body = call(app_with_ids(), "/v1/chat/completions", CHAT, sent)
    (header,) = response_ids(start)
    assert json.loads(body)["id"] == "chatcmpl-" + header.decode()


def test_several_headers_the_first_wins_in_both():
    start, body = call(app_with_ids(), "/v1/chat/completions", CHAT,
                       [(b"x-request-id", b"a1"), (b"x-request-id", b"b2")])
    assert response_ids(start) == [b"a1"] and json.loads(body)["id"] == "chatcmpl-a1"


def test_a_non_ascii_id_body_and_header_agree():
    """UTF-8 bytes in the header: Starlette reads them as latin-1 for the body; the header goes back as bytes."""
    start, body = call(app_with_ids(), "/v1/chat/completions", CHAT, [(b"x-request-id", "é".encode())])
    (header,) = response_ids(start)
    assert json.loads(body)["id"] == "chatcmpl-" + header.decode("utf-8")


@pytest.mark.parametrize("given", [" lead", "trail ", "in side"])
def test_a_body_id_with_edge_spaces_leaves_a_header_http_can_send(given):
    """With --enable-request-id-headers, a body request_id with a leading or trailing space went into X-Request-Id as
    it was: HTTP takes no such header value (h11, uvicorn's, refused the response start and closed the connection,
    the reply lost). Such an id still names the reply; the header carries one HTTP can send."""
    h11 = pytest.importorskip("h11")
    start, body = call(app_with_ids(), "/v1/chat/completions", {**CHAT, "request_id": given}, [])
    h11.Response(status_code=start["status"], headers=start["headers"])  # (raises on a header it cannot send)
    assert json.loads(body)["id"] == "chatcmpl-" + given


def test_the_401_carries_the_header_too():
    start, body = call(app_with_ids(api_key="k"), "/v1/chat/completions", CHAT, [(b"x-request-id", b"z")])
    assert start["status"] == 401 and response_ids(start) == [b"z"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api_key", [None, "k"])
def test_with_request_id_headers_a_client_that_leaves_mid_decode_is_noticed(stream, api_key):
    client = EndlessClient()
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128, api_key=api_key,
                                request_id_headers=True)
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 100_000, "stream": stream}).encode()
    headers = [(b"x-request-id", b"leaver")] + ([(b"authorization", b"Bearer k")] if api_key else [])
    took, sent = leave_mid_request(app, client, "/v1/completions", body, headers)
    assert client.aborted and took < server_app.DISCONNECT_CHECK_S + 0.5, took
    if stream:
        assert response_ids(sent[0]) == [b"leaver"]


PLAIN = ToolOptions()


def chat_reasoning(pieces, body, options=PLAIN, tools=True):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    app = server_app.create_app(ScriptedClient(pieces), builtin_codec(), ServerMetrics(), "m", 128,
                                tool_options=options, reasoning=REASONING_PARSERS["deepseek_r1"])
    req = {"model": "m", "messages": [{"role": "user", "content": "w?"}], **({"tools": [weather]} if tools else {}),
           **body}
    whole, streamed = post_all(app, [("/v1/chat/completions", req), ("/v1/chat/completions", {**req, "stream": True})])
    assert whole.status_code == 200, whole.text
    return whole.json(), sse_events(streamed.text)


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_include_reasoning_false_with_tool_calls(choice):
    call_text = ('[{"name":"get_weather","parameters":{"city":"Oslo"}}]' if choice == "required" else
                 '{"city":"Oslo"}' if isinstance(choice, dict) else
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    pieces = ["Secret ", "thoughts.", "</think>", call_text]
    on, on_chunks = chat_reasoning(pieces, {"tool_choice": choice}, ToolOptions(parser="hermes"))
    off, off_chunks = chat_reasoning(pieces, {"tool_choice": choice, "include_reasoning": False},
                                     ToolOptions(parser="hermes"))
    assert on["choices"][0]["message"]["reasoning"] == "Secret thoughts."
    m_on, m_off = on["choices"][0]["message"], off["choices"][0]["message"]
    assert m_off["reasoning"] is None and m_off["content"] == m_on["content"]
    strip = lambda cs: [{k: v for k, v in c.items() if k != "id"} for c in cs]  # noqa: E731
    assert strip(m_off["tool_calls"]) == strip(m_on["tool_calls"]) and m_off["tool_calls"]
    assert off["choices"][0]["finish_reason"] == on["choices"][0]["finish_reason"]
    assert "Secret" not in json.dumps([c["choices"] for c in off_chunks])
    assert any(tc for c in off_chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", []))


def test_include_reasoning_false_thoughts_cut_by_length():
    off, chunks = chat_reasoning(["<think>", "Secret"], {"include_reasoning": False}, tools=False)
    # (no answer: content null, as with the thoughts sent, and as vLLM answers)
    assert off["choices"][0]["message"] == {"role": "assistant", "content": None, **server_app.MESSAGE_NULLS,
                                            "reasoning": None,
                                            "reasoning_content": None}
    assert "Secret" not in json.dumps([c["choices"] for c in chunks])
