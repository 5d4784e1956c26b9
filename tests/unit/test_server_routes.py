"""The server's routes beside generation, in process (httpx over ASGI, no engine): vLLM's /tokenize and /detokenize,
/version, and --api-key's guard."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import IdleClient, SilentClient, builtin_codec, httpx_module, leave_mid_request  # noqa: E402

from tpgraph import __version__  # noqa: E402
from tpgraph.chat import GenerationDefaults  # noqa: E402
from tpgraph.errors import ConfigError  # noqa: E402
from tpgraph.prompts import PromptCodec  # noqa: E402
from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.tools import template_tools  # noqa: E402
from tpgraph.tokenizer import BOS, EOS, builtin_tokenizer  # noqa: E402

MODEL = "m"


def codec() -> PromptCodec:
    return builtin_codec(MODEL)


def call(requests: list[tuple[str, str, dict | None, dict | None]], api_key: str | None = None) -> list:
    """[(method, path, json body, headers)] -> the responses, in order, from one app."""
    httpx = httpx_module()
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


def test_tokenize_chat_with_tools_template_variables_and_a_continued_message():
    """/tokenize renders what /v1/chat/completions would: the tools, chat_template_kwargs, continue_final_message."""
    c = codec()
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]
    ok, bad = call([("POST", "/tokenize", {"messages": messages, "tools": tools, "add_generation_prompt": False,
                                           "continue_final_message": True}, None),
                    ("POST", "/tokenize", {"messages": messages, "tools": [{"type": "x"}]}, None)])
    text = c.render_chat(messages, False, template_tools(tools), continue_final_message=True)
    assert text.endswith("<|assistant|>\nSure") and '"name": "f", "description": null' in text  # (vLLM's dump)
    assert ok.json()["tokens"] == c.encode_text(text, add_special_tokens=False)
    assert bad.status_code == 400 and "function tools only" in bad.json()["error"]["message"]


def test_a_chat_template_kwargs_add_generation_prompt_gives_way_to_the_requests_own():
    """vLLM lets the request's add_generation_prompt win over one in chat_template_kwargs (merge_kwargs); it was a 400
    here ("may not set add_generation_prompt")."""
    c = codec()
    messages = [{"role": "user", "content": "Hi"}]
    got = call([("POST", "/tokenize", {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
                 None)])[0]
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == c.encode_text(c.render_chat(messages), add_special_tokens=False)


def test_tokenizer_info_names_the_special_tokens_and_the_template():
    """vLLM's /tokenizer_info, which lm-eval's remote tokenizer reads: the BOS the tokenizer adds, the first EOS id's
    token, the chat template's source (each encodes back to its id through /tokenize, as lm-eval's does)."""
    c = codec()
    info, bos, eos = call([("GET", "/tokenizer_info", None, None),
                           ("POST", "/tokenize", {"prompt": BOS, "add_special_tokens": False}, None),
                           ("POST", "/tokenize", {"prompt": EOS, "add_special_tokens": False}, None)])
    info = info.json()
    assert (info["bos_token"], info["eos_token"], info["model_max_length"]) == (BOS, EOS, 128)
    assert info["chat_template"] == c.chat_template.source
    assert bos.json()["tokens"] == [c.tokenizer.token_to_id(BOS)] and eos.json()["tokens"] == list(c.eos_ids)



def test_tokenizer_info_takes_the_configs_special_tokens_else_the_tokenizers(tmp_path):
    """As vLLM: tokenizer_config.json's tokens (a checkpoint whose tokenizer adds no BOS still names one, and an
    instruct model's EOS is its end-of-turn token); without a config, the BOS the tokenizer adds and the first EOS id
    decoded as text (an ordinary token's text, not its byte-level spelling)."""
    from tpgraph.chat import special_tokens, tokenizer_config

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": None}))
    special = special_tokens(tokenizer_config(tmp_path))
    assert special == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tokenizer = builtin_tokenizer()
    info = PromptCodec(tokenizer, None, GenerationDefaults(), MODEL, (10,), special).tokenizer_info(64)
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<|im_start|>", "<|im_end|>", None)
    bare = PromptCodec(tokenizer, None, GenerationDefaults(), MODEL, (10,)).tokenizer_info(64)
    assert (bare["bos_token"], bare["eos_token"], bare["chat_template"]) == (BOS, "\n", None)


def test_a_custom_role_reaches_the_template_as_vllm_hands_it():
    """vLLM takes a message of any role (its CustomChatCompletionMessageParam) and leaves it to the template: Llama
    3.1's tool results come back as "ipython" turns, which its template writes. Such a message was a 400 ("role
    'ipython' is not one of ..."), here and on /v1/chat/completions."""
    c = codec()
    messages = [{"role": "user", "content": "6*7?"}, {"role": "ipython", "content": "42"}]
    r = call([("POST", "/tokenize", {"messages": messages}, None)])[0]
    assert r.status_code == 200, r.text
    text = c.render_chat(messages)
    assert "<|ipython|>\n42" in text and r.json()["tokens"] == c.encode_text(text, add_special_tokens=False)


def test_detokenize_is_the_inverse_and_version_answers():
    c = codec()
    ids = c.encode_text("Hello, tpgraph")
    text, version = call([("POST", "/detokenize", {"model": MODEL, "tokens": ids}, None),
                          ("GET", "/version", None, None)])
    assert text.json() == {"prompt": f"{BOS}Hello, tpgraph"} and version.json() == {"version": __version__}


def test_an_empty_model_name_is_the_model_served_on_the_token_routes():
    """As vLLM's _is_model_supported: an empty `model` names no model, so the one served answers (a 404 here)."""
    tokens, text = call([("POST", "/tokenize", {"model": "", "prompt": "Hi"}, None),
                         ("POST", "/detokenize", {"model": "", "tokens": [104, 105]}, None)])
    assert tokens.status_code == text.status_code == 200, (tokens.text, text.text)
    assert text.json() == {"prompt": "hi"}


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/tokenize", {"model": MODEL}, 400, "give either prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "either prompt or messages"),
    ("/tokenize", {"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role is empty"),
    ("/tokenize", {"prompt": "a\ud800"}, 400, "lone surrogate"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    # (a lone surrogate anywhere in the body is refused before the route, which would quote the name in its 404)
    ("/tokenize", {"model": "m\ud800", "prompt": "x"}, 400, "model is not valid Unicode text"),
    ("/v1/completions", {"model": "m\udfff", "prompt": "x"}, 400, "model is not valid Unicode text"),
    ("/detokenize", {"tokens": [1, 10 ** 9, -2]}, 400, "tokens must be ids in [0, "),
    ("/detokenize", {"tokens": [True]}, 400, "token ids must be integers"),
    ("/detokenize", {}, 400, "tokens: Field required"),
    ("/tokenize", {"prompt": "x" * 4_000_001}, 400, "4000001 characters; /tokenize takes at most 4000000"),
    # (as vLLM's: apply_chat_template refuses an empty conversation; it rendered the generation prompt alone)
    ("/tokenize", {"messages": []}, 400, "an empty conversation"),
    # (as vLLM refuses a request's own template, unless trusted: taken and ignored, the server's rendered the prompt)
    *((path, {"messages": [{"role": "user", "content": "x"}], **extra}, 400, "a chat template sent with the request")
      for path in ("/tokenize", "/v1/chat/completions")
      for extra in ({"chat_template": "{{ messages }}"}, {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}})),
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


def test_the_operators_routes_with_a_trailing_slash_are_not_asked_for_the_key():
    """/metrics/ and /health/ (a scrape or probe configured with the slash) are redirected to /metrics and /health
    without a key; with --api-key they were a 401 instead, though the routes they lead to are open."""
    got = call([("GET", path, None, None) for path in ("/metrics/", "/health/", "/v1/models/")], api_key="s3cret")
    assert [r.status_code for r in got] == [307, 307, 401]
    assert [r.headers["location"] for r in got[:2]] == ["http://t/metrics", "http://t/health"]


def test_a_body_nested_past_the_json_readers_depth_is_left_to_a_route_that_reads_none():
    """The app's lone-surrogate check decodes every body: one nested some thousands deep (json.loads raises
    RecursionError, no ValueError) made /ping, /v1/models and every other route without a body model a 500."""
    httpx = httpx_module()
    app = server_app.create_app(IdleClient(), codec(), ServerMetrics(), MODEL, 128)
    deep = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000

    async def main() -> list:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return [await http.request(method, path, content=deep, headers={"Content-Type": "application/json"})
                    for method, path in (("POST", "/ping"), ("GET", "/v1/models"), ("POST", "/tokenize"))]

    ping, models, tokenize = asyncio.run(main())
    assert (ping.status_code, models.status_code, tokenize.status_code) == (200, 200, 400), tokenize.text


def test_the_bearer_scheme_is_read_in_any_case_as_vllms():
    """vLLM's AuthenticationMiddleware takes the scheme in any case (`scheme.lower() != "bearer"`), as HTTP's schemes
    are: `bearer KEY` was a 401 here. The key itself is still matched exactly, and another scheme is still refused."""
    body = {"prompt": "x"}
    replies = call([("POST", "/tokenize", body, {"Authorization": header})
                    for header in ("bearer s3cret", "BEARER s3cret", "bearer S3CRET", "Basic s3cret", "s3cret")],
                   api_key="s3cret")
    assert [r.status_code for r in replies] == [200, 200, 401, 401, 401]


@pytest.mark.parametrize("api_key", [None, "k3y", "clé"])
def test_with_a_key_a_client_that_leaves_is_still_noticed(api_key):
    """The key's check must not hide the client's going away from the endpoint (Starlette's BaseHTTPMiddleware,
    behind FastAPI's @app.middleware, did: a request whose client left ran on to max_tokens). The ASGI exchange as
    uvicorn makes it: the body, then nothing until the client leaves. A key that is not ASCII matches as UTF-8."""
    client = SilentClient()
    app = server_app.create_app(client, codec(), ServerMetrics(), MODEL, 128, api_key=api_key)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4}).encode()
    headers = [(b"authorization", b"Bearer " + api_key.encode())] if api_key else []
    took, sent = leave_mid_request(app, client, "/v1/completions", body, headers)
    assert client.aborted and took < server_app.DISCONNECT_CHECK_S + 0.5, (took, sent[:1])


def test_several_served_model_names_are_each_answered_and_listed():
    """vLLM's --served-model-name takes several names: a request may name any of them, a reply names the first, and
    /v1/models lists each. The flag took one name (a vLLM command line with two was refused)."""
    from tpgraph.serve import parse_args

    assert parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    httpx = httpx_module()
    app = server_app.create_app(IdleClient(), codec(), ServerMetrics(), "a", 128, served_names=("a", "b"))

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [await http.get("/v1/models"),
                    *[await http.post("/tokenize", json={"model": name, "prompt": "x"}) for name in ("a", "b", "c")]]

    models, first, second, unknown = asyncio.run(main())
    assert [card["id"] for card in models.json()["data"]] == ["a", "b"]
    assert first.status_code == second.status_code == 200, second.text
    assert unknown.status_code == 404 and "this server serves `a`, `b`" in unknown.json()["error"]["message"]


def test_models_names_the_checkpoint_served_as_root():
    """vLLM's /v1/models cards carry `root`, the --model the names stand for (clients that load a tokenizer read it),
    and `parent` (null but for adapters); both were missing."""
    httpx = httpx_module()
    app = server_app.create_app(IdleClient(), codec(), ServerMetrics(), "a", 128, served_names=("a", "b"),
                                model_root="meta-llama/Llama-3.1-8B-Instruct")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.get("/v1/models")

    cards = asyncio.run(main()).json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [("a", "meta-llama/Llama-3.1-8B-Instruct", None),
                                                                  ("b", "meta-llama/Llama-3.1-8B-Instruct", None)]
    assert call([("GET", "/v1/models", None, None)])[0].json()["data"][0]["root"] == MODEL  # (no --model: its name)


def test_several_api_keys_are_each_taken():
    """vLLM's --api-key takes several keys (a client may send any of them, as when one is being rotated out); a
    second key was refused as an unrecognized argument."""
    from tpgraph.serve import parse_args

    assert parse_args(["--api-key", "old", "new"]).api_key == ["old", "new"]
    httpx = httpx_module()
    app = server_app.create_app(IdleClient(), codec(), ServerMetrics(), MODEL, 128, api_key=("old", "new"))

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                    for key in ("old", "new", "oldnew", "")]

    assert [r.status_code for r in asyncio.run(main())] == [200, 200, 401, 401]


def test_default_chat_template_kwargs_are_each_overridden_by_the_requests():
    """vLLM's --default-chat-template-kwargs: the template variables every chat starts from; a request's own
    chat_template_kwargs override them one by one. /tokenize renders as the chat route does."""
    import dataclasses

    from tpgraph.chat import ChatTemplate
    from tpgraph.server.options import HttpOptions

    httpx = httpx_module()
    template = ChatTemplate("{{ greeting | default('none') }}|{{ tone | default('none') }}|"
                            "{% for m in messages %}{{ m.content }}{% endfor %}", {"bos_token": BOS})
    c = dataclasses.replace(codec(), chat_template=template)
    http = HttpOptions(default_chat_template_kwargs={"greeting": "hi", "tone": "dry"})
    app = server_app.create_app(IdleClient(), c, ServerMetrics(), MODEL, 128, http=http)
    messages = [{"role": "user", "content": "x"}]

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.post("/tokenize", json={"messages": messages, **extra})
                    for extra in ({}, {"chat_template_kwargs": {"tone": "warm"}})]

    plain, overridden = asyncio.run(main())
    assert plain.json()["tokens"] == c.encode_text("hi|dry|x", add_special_tokens=False)
    assert overridden.json()["tokens"] == c.encode_text("hi|warm|x", add_special_tokens=False)
    for bad in ({"messages": []}, {"chat_template": "{{ 1 }}"}, "text"):
        with pytest.raises(ConfigError, match="--default-chat-template-kwargs"):
            HttpOptions(default_chat_template_kwargs=bad)


def test_ping_answers_as_health_with_or_without_a_key():
    """vLLM's /ping (SageMaker's health check), GET or POST, open under --api-key as /health is."""
    got = call([("GET", "/ping", None, None), ("POST", "/ping", None, None)], api_key="s3cret")
    assert [r.status_code for r in got] == [200, 200]
    httpx = httpx_module()
    gone = IdleClient()
    gone.alive = False  # (the engine is gone: /health's 503, and so /ping's)
    app = server_app.create_app(gone, codec(), ServerMetrics(), MODEL, 128)

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [(await client.request(m, p)).status_code for m, p in (("GET", "/health"), ("GET", "/ping"))]

    assert asyncio.run(main()) == [503, 503]


def test_served_names_begin_with_the_name_replies_give():
    with pytest.raises(ValueError, match="must begin with model_name"):
        server_app.create_app(IdleClient(), codec(), ServerMetrics(), MODEL, 128, served_names=("other", MODEL))


def test_each_model_card_carries_vllms_permission_entry():
    """vLLM's /v1/models cards each carry `permission`, one model_permission object (sampling, logprobs and view
    allowed; engines, search indices and fine-tuning not); a client that reads card["permission"] got a KeyError."""
    (models,) = call([("GET", "/v1/models", None, None)])
    (perm,) = models.json()["data"][0]["permission"]
    assert perm["id"].startswith("modelperm-") and perm["object"] == "model_permission"
    assert isinstance(perm["created"], int) and (perm["organization"], perm["group"]) == ("*", None)
    assert [perm[k] for k in ("allow_create_engine", "allow_sampling", "allow_logprobs", "allow_search_indices",
                              "allow_view", "allow_fine_tuning", "is_blocking")] == [False, True, True, False, True,
                                                                                     False, False]


class _Gate:
    """A tokenizer's or template's work that blocks until the test lets it go: `entered` once it blocks, `waited`
    whether each call was let go (False: it gave up, never released while it held the thread it ran on)."""

    def __init__(self) -> None:
        import threading

        self.entered, self.released, self.waited = threading.Event(), threading.Event(), []

    def hold(self) -> None:
        self.entered.set()
        self.waited.append(self.released.wait(timeout=10))  # (a guard: on the event loop nothing could release it)


def _gated_codec(gate: _Gate) -> PromptCodec:
    """The built-in codec whose decode and chat template block on the gate."""
    import dataclasses

    from tpgraph.chat import ChatTemplate

    c = codec()

    class Template(ChatTemplate):
        def render(self, *args, **kwargs) -> str:
            gate.hold()
            return super().render(*args, **kwargs)

    class Tokenizer:
        def __getattr__(self, name: str):
            return getattr(c.tokenizer, name)

        def decode(self, *args, **kwargs) -> str:
            gate.hold()
            return c.tokenizer.decode(*args, **kwargs)

    return dataclasses.replace(c, tokenizer=Tokenizer(), chat_template=Template(c.chat_template.source,
                                                                                c.special_tokens))


def _served_while_held(app, gate: _Gate, path: str, body: dict):
    """POST body to path, and while its tokenizer work is held at the gate, GET /version: asserts that one is answered
    with the POST still held (on a thread, every wait through the gate), then releases it; returns the POST's reply."""
    httpx = httpx_module()

    async def main() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            held = asyncio.create_task(http.post(path, json=body))
            await asyncio.to_thread(gate.entered.wait, 10)
            other = await http.get("/version")
            still_held = not held.done()
            gate.released.set()
            return other, still_held, await held

    other, still_held, held = asyncio.run(main())
    assert other.status_code == 200 and still_held and gate.waited == [True] * len(gate.waited), gate.waited
    return held


@pytest.mark.parametrize(("path", "body"), [
    ("/detokenize", {"tokens": [104, 105]}),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
])
def test_other_requests_are_served_while_a_tokenizer_or_template_works(path, body):
    """Detokenizing and rendering a chat template ran on the event loop: a long prompt's held up every other request
    and stream. They run on a thread now: a request is answered while another's is still at work."""
    from tpgtest.server_stubs import OneTokenClient

    gate = _Gate()
    app = server_app.create_app(OneTokenClient(), _gated_codec(gate), ServerMetrics(), MODEL, 128)

    held = _served_while_held(app, gate, path, {"model": MODEL, **body})
    assert held.status_code == 200, held.text


def test_other_requests_are_served_while_a_beam_searchs_text_is_decoded():
    """A beam search's reply decoded each finished sequence's text on the event loop: a long reply held up every other
    request and stream. It is decoded on a thread now, as /detokenize's text is."""
    from types import SimpleNamespace

    from tpgtest.server_stubs import ScriptedClient

    gate = _Gate()
    client = ScriptedClient(["x"], finish="length")
    client.limits = SimpleNamespace(max_logprobs=20, max_model_len=128)  # (what a beam search's checks read)
    app = server_app.create_app(client, _gated_codec(gate), ServerMetrics(), MODEL, 128)

    held = _served_while_held(app, gate, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "n": 2,
                                                             "use_beam_search": True})
    assert held.status_code == 200, held.text
    assert [c["text"] for c in held.json()["choices"]] == ["\x07"]  # (the stub's one candidate: one sequence)


def test_a_wrong_keys_comparison_tells_nothing_of_the_keys_length(monkeypatch):
    """secrets.compare_digest takes time by its inputs' lengths where they differ: comparing the key as sent with the
    key itself let a client time out how long the key is. As vLLM's AuthenticationMiddleware, both sides are
    compared as SHA-256 digests, of one length whatever was sent."""
    from tpgraph.server import auth

    compared = []
    real = auth.secrets.compare_digest

    def recording(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.secrets, "compare_digest", recording)
    replies = call([("POST", "/tokenize", {"prompt": "x"}, headers) for headers in (
        {"Authorization": "Bearer x"}, {"x-api-key": "a-much-longer-guess-than-the-key"},
        {"Authorization": "Bearer s3cret"})], api_key="s3cret")
    assert [r.status_code for r in replies] == [401, 401, 200]
    assert compared and set(compared) == {(32, 32)}, compared
