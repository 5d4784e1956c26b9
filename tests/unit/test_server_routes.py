"""The server's routes beside generation, in process (httpx over ASGI, no engine): vLLM's /tokenize and /detokenize,
/version, and --api-key's guard."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from tpgraph import __version__  # noqa: E402
from tpgraph.chat import ChatTemplate, GenerationDefaults  # noqa: E402
from tpgraph.prompts import PromptCodec  # noqa: E402
from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.tokenizer import BOS, builtin_tokenizer  # noqa: E402

MODEL = "m"


class IdleClient:
    """An engine that must not be reached: these routes never submit anything."""

    alive, error = True, None

    def attach(self, loop) -> None:
        pass

    def check(self, *_) -> None:
        raise AssertionError("the engine was asked")

    submit = check

    async def engine_metrics(self) -> str:
        return ""


def codec() -> PromptCodec:
    return PromptCodec(builtin_tokenizer(), ChatTemplate.from_dir(None, BOS), GenerationDefaults(), MODEL)


def call(requests: list[tuple[str, str, dict | None, dict | None]], api_key: str | None = None) -> list:
    """[(method, path, json body, headers)] -> the responses, in order, from one app."""
    try:
        import httpx
    except ImportError:  # (openai 3 brings it under this name)
        httpx = pytest.importorskip("httpx2")
    app = server_app.create_app(IdleClient(), codec(), ServerMetrics(), MODEL, 128, api_key=api_key)

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            # (json.dumps escapes a lone surrogate, as a client that sends one does; httpx's encoder would refuse it)
            return [await http.request(method, path, headers={"Content-Type": "application/json", **(headers or {})},
                                       content=None if body is None else json.dumps(body))
                    for method, path, body, headers in requests]

    return asyncio.run(main())


def test_tokenize_a_prompt_and_chat_messages_as_the_completions_would():
    c = codec()
    messages = [{"role": "user", "content": "Hi"}]
    prompt, chat, bare, strs = call([
        ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello"}, None),
        ("POST", "/tokenize", {"messages": messages}, None),
        ("POST", "/tokenize", {"prompt": "Hello", "add_special_tokens": False}, None),
        ("POST", "/tokenize", {"prompt": "Hi", "return_token_strs": True}, None)])
    assert prompt.status_code == 200, prompt.text
    ids = c.encode_text("Hello")
    assert prompt.json() == {"count": len(ids), "max_model_len": 128, "tokens": ids, "token_strs": None}
    assert ids[0] == c.tokenizer.token_to_id(BOS) and bare.json()["tokens"] == ids[1:]
    # chat: the template's text, its special tokens not doubled, as /v1/chat/completions encodes it
    assert chat.json()["tokens"] == c.encode_text(c.render_chat(messages), add_special_tokens=False)
    assert strs.json()["token_strs"] == [BOS, "H", "i"]


def test_detokenize_is_the_inverse_and_version_answers():
    c = codec()
    ids = c.encode_text("Hello, tpgraph")
    text, version = call([("POST", "/detokenize", {"model": MODEL, "tokens": ids}, None),
                          ("GET", "/version", None, None)])
    assert text.json() == {"prompt": f"{BOS}Hello, tpgraph"} and version.json() == {"version": __version__}


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/tokenize", {"model": MODEL}, 400, "give either prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "either prompt or messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role 'wizard' is not one of"),
    ("/tokenize", {"prompt": "a\ud800"}, 400, "lone surrogate"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ("/detokenize", {"tokens": [1, 10 ** 9, -2]}, 400, "tokens must be ids in [0, "),
    ("/detokenize", {"tokens": [True]}, 400, "token ids must be integers"),
    ("/detokenize", {}, 400, "tokens: Field required"),
])
def test_bad_token_requests_get_the_reason(path, body, status, needle):
    r = call([("POST", path, body, None)])[0]
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_an_api_key_guards_every_route_but_the_operators():
    body = {"prompt": "x"}
    no_key, wrong, right, health, version, unguarded = call([
        ("POST", "/tokenize", body, None),
        ("POST", "/tokenize", body, {"Authorization": "Bearer nope"}),
        ("POST", "/tokenize", body, {"Authorization": "Bearer s3cret"}),
        ("GET", "/health", None, None),
        ("GET", "/version", None, None),
        ("GET", "/v1/models", None, None),
    ], api_key="s3cret")
    for r, needle in ((no_key, "needs an API key"), (wrong, "the API key is wrong"), (unguarded, "needs an API key")):
        assert r.status_code == 401 and needle in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "AuthenticationError" and r.headers["www-authenticate"] == "Bearer"
    assert right.status_code == health.status_code == version.status_code == 200
    assert call([("GET", "/v1/models", None, None)])[0].status_code == 200  # without a key set, nothing is asked
