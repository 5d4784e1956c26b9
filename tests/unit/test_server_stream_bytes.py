"""The exact bytes of streamed chat and completion replies, pinned (server_streams/<case>.txt): the per-token path
is tuned for speed, and a client must not see one byte change (key order, separators, escapes, null fields, usage,
logprobs, token ids, the role and usage chunks, [DONE])."""

import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import ScriptedClient, builtin_codec, post_all  # noqa: E402

from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402

GOLDEN = Path(__file__).parent / "server_streams"
# (a quote, a newline and a non-ASCII character: the JSON escapes must stay as they were)
PIECES = ["He", "\u00e9\"\n", "!"]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
EVERYTHING = {"return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CASES = {
    "chat_plain": ("/v1/chat/completions", CHAT),
    "chat_everything": ("/v1/chat/completions", {**CHAT, **EVERYTHING, "n": 2, "logprobs": True, "top_logprobs": 1}),
    "completions_plain": ("/v1/completions", {"prompt": "hi"}),
    "completions_everything": ("/v1/completions", {"prompt": "hi", **EVERYTHING, "n": 2, "logprobs": 1,
                                                   "echo": True}),
    "completions_usage": ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
}


def streamed(path: str, extra: dict) -> bytes:
    app = server_app.create_app(ScriptedClient(PIECES, stop_reason="END"), builtin_codec(), ServerMetrics(), "m", 128)
    body = {"model": "m", "stream": True, "max_tokens": 3, "request_id": "fixed", **extra}
    reply = post_all(app, [(path, body)])[0]
    assert reply.status_code == 200
    return reply.content


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_streamed_reply_is_byte_for_byte_as_pinned(case, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1700000000.5)  # (each chunk's "created")
    got = streamed(*CASES[case])
    assert got == (GOLDEN / f"{case}.txt").read_bytes()


def test_an_event_is_json_dumps_text_without_an_encoder_built_for_it(monkeypatch):
    """sse() writes what json.dumps writes (escapes, separators, floats, int keys), but json.dumps built its encoder
    anew for every event, about half of a streamed token's JSON cost: sse's is built once."""
    import json

    from tpgraph.server.sse import sse, typed_sse

    event = {"type": "t", "a": [1, -0.5, 1e-7, None, True], "é\"\n": {"\u2028": "\U0001f600"}, "top": {7: -9999.0}}
    expected = json.dumps(event)

    def built(*_, **__):
        raise AssertionError("an encoder was built for the event")

    monkeypatch.setattr(json.JSONEncoder, "iterencode", built)
    assert sse(event) == f"data: {expected}\n\n"
    assert typed_sse(event) == f"event: t\ndata: {expected}\n\n"
    assert sse("[DONE]") == "data: [DONE]\n\n"
