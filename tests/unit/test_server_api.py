"""The server's request loop without HTTP: a client that leaves is noticed while its request still streams updates,
and an engine failure after a stream began ends it with an error event and [DONE]."""

import asyncio
import contextlib
import json
import time

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import (  # noqa: E402
    EndlessClient,
    FailingClient,
    OneTokenClient,
    ScriptedClient,
    SilentClient,
    builtin_codec,
    httpx_module,
    post_all,
    sse_events,
)

LABELS = {"model_name": "tpgraph", "engine": "0"}  # (ServerMetrics' default model_name)

from tpgraph.engine.sampling_params import SamplingParams  # noqa: E402
from tpgraph.engine.updates import REFUSED, StepUpdate  # noqa: E402
from tpgraph.errors import RequestError  # noqa: E402
from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server import sse as server_sse  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.options import HttpOptions  # noqa: E402
from tpgraph.tokenizer import BOS  # noqa: E402


class LeavingRequest:
    """An HTTP request whose client goes away `after` seconds after it is made."""

    def __init__(self, after: float) -> None:
        self.after, self.start = after, time.monotonic()

    async def is_disconnected(self) -> bool:
        return time.monotonic() - self.start >= self.after


def test_a_client_that_leaves_mid_decode_is_noticed_and_its_request_aborted():
    """A non-streaming request gets an update every few ms; it used to check its client only after a second
    without one, so a decoding request ran on to its end after the client had gone."""
    client, request = EndlessClient(), LeavingRequest(after=0.3)
    api = server_app.Api(client, ServerMetrics(), "m")

    async def main() -> int:
        got = 0
        async for _ in api.run(request, [[1, 2]], SamplingParams(max_tokens=10_000)):
            got += 1
        return got

    got = asyncio.run(asyncio.wait_for(main(), timeout=10))
    took = time.monotonic() - request.start
    assert len(client.aborted) == 1 and got > 10  # it was decoding all along, and was aborted
    assert took < request.after + server_app.DISCONNECT_CHECK_S + 0.5  # noticed at the next check (0.5 s: a slow CI)


@pytest.mark.parametrize(("failure", "expected"), [
    (server_app.ApiError(500, "the engine failed: gone", "InternalServerError"),
     (500, "the engine failed: gone", "InternalServerError")),
    (server_app.EngineUnavailable("the engine stopped: x"), (503, "the engine stopped: x", "ServiceUnavailableError")),
    (RequestError("a bad request"), (400, "a bad request", "BadRequestError")),
    (KeyError("index"), (500, "'index'", "InternalServerError")),
])
def test_a_guarded_stream_that_fails_ends_with_an_error_event_and_done(failure, expected):
    """_guarded, which both endpoints' streams go through: a failure after the first event (the 200 is sent). As
    vLLM's stream generators (`except Exception`), any failure ends it so, not only the engine's: a refusal as the
    400 a whole reply gets for it, anything else as a 500 (it cut the connection, with no error event or [DONE])."""
    async def events():
        yield server_sse.sse({"choices": [{"text": "a"}]})
        raise failure

    async def collect() -> list[str]:
        return [e async for e in server_sse.guarded(events())]

    got = asyncio.run(collect())
    assert len(got) == 3 and got[-1] == "data: [DONE]\n\n"
    error = json.loads(got[1].removeprefix("data: "))["error"]
    assert (error["code"], error["message"], error["type"]) == expected


@pytest.mark.parametrize(("gone", "raised", "message"), [
    (True, server_app.EngineUnavailable, "the engine is unavailable: the engine is shutting down"),
    (False, server_app.ApiError, "the engine failed: ValueError: a bad step"),
])
def test_an_engine_that_is_gone_is_a_503_and_a_failed_step_a_500(gone, raised, message):
    api = server_app.Api(FailingClient(gone), ServerMetrics(), "m")

    async def main() -> None:
        async for _ in api.run(LeavingRequest(after=60), [[1, 2]], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(raised) as info:
        asyncio.run(main())
    assert str(info.value) == message
    # (a failed step: vLLM's GenerationError, a 500 of type InternalServerError)
    assert raised is not server_app.ApiError or (info.value.status, info.value.kind) == (500, "InternalServerError")


class BuggyClient(EndlessClient):
    """An engine client with a bug: its check raises what no route answers."""

    def check(self, prompt, params) -> None:
        raise KeyError("a bug")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failure_no_route_answers_is_a_500_in_openais_error_shape(path):
    """A bug's exception reached Starlette, whose 500 is the plain text "Internal Server Error": a client reading the
    OpenAI error body got none. vLLM's routes answer it as a JSON 500 naming the failure."""
    httpx = httpx_module()
    app = server_app.create_app(BuggyClient(), builtin_codec("m"), ServerMetrics(), "m", 128)
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, json={**body, "max_tokens": 2})

    got = asyncio.run(main())
    assert got.status_code == 500
    assert got.json()["error"] == {"message": "'a bug'", "type": "InternalServerError", "param": None, "code": 500}


def test_a_500_carries_the_request_id_and_cors_headers_as_every_other_reply():
    """A failure no route answers was answered by Starlette's outermost middleware, outside the server's own: the 500
    lacked X-Request-Id (--enable-request-id-headers: the reply that most needs finding in the logs) and the CORS
    headers, so a browser page could not read it at all. It is answered inside them now, in the same error shape."""
    httpx = httpx_module()
    app = server_app.create_app(BuggyClient(), builtin_codec("m"), ServerMetrics(), "m", 128, request_id_headers=True)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                   headers={"X-Request-Id": "abc", "Origin": "https://page.example"})

    got = asyncio.run(main())
    assert got.status_code == 500
    assert got.json()["error"] == {"message": "'a bug'", "type": "InternalServerError", "param": None, "code": 500}
    assert got.headers["x-request-id"] == "abc" and got.headers["access-control-allow-origin"] == "*"


class UnreachableClient(EndlessClient):
    """An engine found gone as a request is submitted (the bridge's submit raises)."""

    def submit(self, request_id, prompt, params, sink) -> None:
        raise server_app.EngineUnavailable("the engine stopped: gone")


@pytest.mark.parametrize(("client", "errors"), [(FailingClient(True), 2), (FailingClient(False), 2),
                                               (UnreachableClient(), 0)], ids=["gone", "failed-step", "gone-at-submit"])
def test_a_request_the_engine_failed_is_counted_as_an_error_not_an_abort(client, errors):
    """An engine failure (a step that raised, or the engine gone) ends the request with a 500 or 503; it was counted
    under finish_reason "abort", as if its client had left, and no request was ever counted as an error. One whose
    prompts were never sent (the engine found gone as the first was submitted) never started: it is counted as
    neither (test_bridge's broken pipe: the prompts sent before it broke are errors)."""
    metrics = ServerMetrics()
    api = server_app.Api(client, metrics, "m")

    async def main() -> None:
        async for _ in api.run(LeavingRequest(after=60), [[1, 2], [3]], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises((server_app.EngineUnavailable, server_app.ApiError)):
        asyncio.run(main())
    registry = metrics.registry
    assert registry.get_sample_value("vllm:request_success_total", {**LABELS, "finished_reason": "error"}) == errors
    assert registry.get_sample_value("vllm:request_success_total", {**LABELS, "finished_reason": "abort"}) == 0


def test_tokenizing_does_not_hold_up_the_event_loop(monkeypatch):
    """A prompt that takes long to tokenize is encoded on a thread: /health answers meanwhile (a 9 MB prompt used
    to freeze every endpoint for the 11 s it took)."""
    httpx = httpx_module()
    codec = builtin_codec(chat=False)
    slow = codec.encode_text

    def encode_text(*args, **kwargs):
        time.sleep(1.0)  # (as a long prompt's tokenizing would, with the GIL let go)
        return slow(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_text", encode_text)
    app = server_app.create_app(OneTokenClient(), codec, ServerMetrics(), "m", 128)

    async def main() -> tuple[int, int, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            completion = asyncio.create_task(http.post("/v1/completions", json={"model": "m", "prompt": "hi"}))
            start = time.monotonic()
            await asyncio.sleep(0.2)  # (the completion is being tokenized by then; on the loop it would hold it 1 s)
            health = await http.get("/health")
            took = time.monotonic() - start
            return (await completion).status_code, health.status_code, took

    completion, health, took = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert (completion, health) == (200, 200) and took < 0.7, took


def test_a_request_the_engine_refuses_is_a_400_counted_as_refused_and_not_aborted():
    """The engine refuses a request as it comes to add it (a grammar that does not compile): the front end raises
    the reason as a RequestError (a 400), counts it as refused, and sends no abort for what was never added."""
    from tpgraph.engine.updates import REFUSED, StepUpdate
    from tpgraph.errors import RequestError

    class RefusingClient(EndlessClient):
        def submit(self, request_id, prompt, params, sink) -> None:
            sink(StepUpdate(request_id, 0, None, "the regex cannot be used: Unclosed '['", REFUSED))

    client, metrics = RefusingClient(), ServerMetrics()
    api = server_app.Api(client, metrics, "m")

    async def main() -> None:
        async for _ in api.run(LeavingRequest(after=60), [[1, 2]], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(RequestError, match="the regex cannot be used"):
        asyncio.run(main())
    get = metrics.registry.get_sample_value
    # (counted as refused alone: vLLM answers such a request before its engine, so it is no finished request)
    assert client.aborted == [] and get("tpgraph_requests_refused_total") == 1
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": REFUSED}) is None

    async def three() -> None:  # (three prompts, the same params: the others are aborted, and counted refused too)
        async for _ in api.run(LeavingRequest(after=60), [[1], [2], [3]], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(RequestError):
        asyncio.run(three())
    assert len(client.aborted) == 2 and get("tpgraph_requests_refused_total") == 4
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": "abort"}) == 0
    assert get("vllm:e2e_request_latency_seconds_count", LABELS) == 0


def test_prompt_tokens_are_counted_as_a_samples_prompt_is_computed_not_as_a_request_arrives():
    """vllm:prompt_tokens, as vLLM's: each sample's prompt once it is computed (with its first
    token). They were counted as the request arrived, so a request the engine refused (never run) or one aborted
    while it waited in the queue counted prompt tokens no step computed."""
    from tpgraph.engine.updates import REFUSED, StepUpdate

    class RefusingClient(EndlessClient):
        def submit(self, request_id, prompt, params, sink) -> None:
            sink(StepUpdate(request_id, 0, None, "the regex cannot be used", REFUSED))

    def prompt_tokens(client, leave_after: float, n: int = 1) -> float | None:
        metrics = ServerMetrics()

        async def main() -> None:
            async for _ in server_app.Api(client, metrics, "m").run(LeavingRequest(after=leave_after), [[1, 2, 3]],
                                                                    SamplingParams(max_tokens=4, n=n)):
                pass

        with contextlib.suppress(Exception):
            asyncio.run(asyncio.wait_for(main(), timeout=10))
        return metrics.registry.get_sample_value("vllm:prompt_tokens_total", LABELS)

    assert prompt_tokens(RefusingClient(), leave_after=60) == 0
    assert prompt_tokens(SilentClient(), leave_after=0.1) == 0  # (queued, then its client left)
    assert prompt_tokens(ScriptedClient(["a", "b"]), leave_after=60, n=2) == 6  # (each sample's, as vLLM's)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(path):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far (plain include_usage: null
    until the last chunk)."""
    app = server_app.create_app(ScriptedClient(["a", "b", "c"]), builtin_codec(), ServerMetrics(), "m", 128)
    body = {"model": "m", "stream": True, "max_tokens": 3,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}

    def main(options: dict, n: int = 1) -> list[dict]:
        return sse_events(post_all(app, [(path, {**body, "stream_options": options, "n": n})])[0].text)

    chunks = main({"include_usage": True, "continuous_usage_stats": True})
    tokens = [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]  # (a token each)
    assert [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3]
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    # with n = 2, each chunk counts its own choice's tokens (as vLLM's do); the last, all of them
    two = main({"include_usage": True, "continuous_usage_stats": True}, n=2)
    per_choice = [(c["choices"][0]["index"], c["usage"]["completion_tokens"]) for c in two
                  if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
    assert sorted(per_choice) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert two[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0 for c in chunks)
    plain = main({"include_usage": True})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 3
    # continuous_usage_stats alone asks for nothing (vLLM's: only with include_usage); a usage chunk with no choices
    # at the end broke clients that read chunk.choices[0] and never asked for usage
    alone = main({"continuous_usage_stats": True})
    assert all("usage" not in c and c["choices"] for c in alone)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop_reason", ["END", 13, None])
def test_a_choice_says_which_stop_ended_it(path, stop_reason):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice (None for an EOS), beside its
    finish_reason, in a reply and in a stream's last chunk (null before it); clients tell their stops apart by it."""
    app = server_app.create_app(ScriptedClient(["a", "b"], stop_reason=stop_reason), builtin_codec(), ServerMetrics(),
                                "m", 128)
    body = {"model": "m", "max_tokens": 3,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    reply, streamed = post_all(app, [(path, body), (path, {**body, "stream": True})])
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_reason
    chunks = [c["choices"][0] for c in sse_events(streamed.text) if c["choices"]]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == stop_reason
    assert all(c["stop_reason"] is None for c in chunks[:-1])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    """vLLM's truncate_prompt_tokens: the last k tokens run (a prompt longer than the context too), echo returns
    them, and a bad k is a 400."""
    codec, client = builtin_codec(), ScriptedClient(["x"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    long_prompt = "word " * 500  # (past what 128 tokens can hold: refused untruncated before it is tokenized)
    completion, chat, refused, bad, over, boolean, uncut = post_all(app, [
                ("/v1/completions", {"model": "m", "prompt": long_prompt, "truncate_prompt_tokens": 5,
                                     "echo": True, "max_tokens": 1}),
                ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": long_prompt}],
                                          "truncate_prompt_tokens": -1, "max_tokens": 8}),
                ("/v1/completions", {"model": "m", "prompt": long_prompt}),
                ("/v1/completions", {"model": "m", "prompt": "x", "truncate_prompt_tokens": 0}),
                ("/v1/completions", {"model": "m", "prompt": "x", "truncate_prompt_tokens": 129}),
                ("/v1/completions", {"model": "m", "prompt": "x", "truncate_prompt_tokens": True}),
                ("/v1/completions", {"model": "m", "prompt": "café", "truncate_prompt_tokens": 100, "echo": True,
                                     "max_tokens": 1})])
    kept = codec.encode_text(long_prompt)[-5:]
    assert client.prompts[0] == kept and completion.json()["usage"]["prompt_tokens"] == 5
    assert completion.json()["choices"][0]["text"] == codec.decode(kept) + "x"
    assert len(client.prompts[1]) == 120 and chat.json()["usage"]["prompt_tokens"] == 120  # (-1: room for 8)
    assert refused.status_code == bad.status_code == over.status_code == boolean.status_code == 400
    assert "2500 characters, more than 128 tokens" in refused.json()["error"]["message"]
    assert "truncate_prompt_tokens must be between 1" in bad.json()["error"]["message"]
    assert "truncate_prompt_tokens must be between 1 and 112 (max_model_len 128 less max_tokens 16)" in \
        over.json()["error"]["message"]
    assert "must be an integer" in boolean.json()["error"]["message"]
    assert uncut.json()["choices"][0]["text"] == "caféx"  # (nothing cut: the prompt's own text is echoed)


def test_an_empty_text_prompt_runs_from_the_tokenizers_bos_as_vllms():
    """vLLM tokenizes a completion's "" prompt and runs what it comes to: BOS alone with a Llama tokenizer, a
    generation from nothing (refused only where it comes to no tokens). It was refused before it was tokenized."""
    codec, client = builtin_codec(), ScriptedClient(["x"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    ran, bare, no_ids = post_all(app, [("/v1/completions", {"model": "m", "prompt": "", "max_tokens": 1}),
                                       ("/v1/completions", {"model": "m", "prompt": ["a", ""], "max_tokens": 1,
                                                            "add_special_tokens": False}),
                                       ("/v1/completions", {"model": "m", "prompt": [[]], "max_tokens": 1})])
    assert ran.status_code == 200, ran.text
    assert client.prompts == [codec.encode_text("")] and codec.encode_text("") == [codec.tokenizer.token_to_id(BOS)]
    assert ran.json()["usage"]["prompt_tokens"] == 1
    assert bare.status_code == no_ids.status_code == 400 and len(client.prompts) == 1
    assert "the prompt is empty: it comes to no tokens" in bare.json()["error"]["message"]
    assert "the prompt is empty" in no_ids.json()["error"]["message"]


def test_truncation_side_right_keeps_the_prompts_first_tokens_as_vllms():
    """vLLM's truncation_side (completion and chat requests): "right" keeps the prompt's first truncate_prompt_tokens
    tokens, "left" (the default) its last; another value is a 400. (It was ignored: "right" ran the last tokens.)"""
    codec, client = builtin_codec(), ScriptedClient(["x"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    long_prompt = "one two three " + "word " * 500
    right, chat, left, other = post_all(app, [
        ("/v1/completions", {"model": "m", "prompt": long_prompt, "truncate_prompt_tokens": 5,
                             "truncation_side": "right", "echo": True, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": long_prompt}],
                                  "truncate_prompt_tokens": 7, "truncation_side": "right", "max_tokens": 1}),
        ("/v1/completions", {"model": "m", "prompt": long_prompt, "truncate_prompt_tokens": 5,
                             "truncation_side": "left", "max_tokens": 1}),
        ("/v1/completions", {"model": "m", "prompt": "x", "truncate_prompt_tokens": 5, "truncation_side": "middle"})])
    first = codec.encode_text(long_prompt)[:5]
    assert right.status_code == chat.status_code == left.status_code == 200
    assert client.prompts[0] == first and right.json()["choices"][0]["text"] == codec.decode(first) + "x"
    assert len(client.prompts[1]) == 7 and client.prompts[1][0] == codec.encode_text(long_prompt)[0]  # (the BOS)
    assert client.prompts[2] == codec.encode_text(long_prompt)[-5:]
    assert other.status_code == 400 and "truncation_side" in other.json()["error"]["message"]


def test_truncate_prompt_tokens_is_held_to_what_max_tokens_leaves_of_max_model_len_as_vllms():
    """vLLM's TokenizeParams (renderers/params.py): truncate_prompt_tokens keeps at most max_model_len less the
    request's max_tokens (-1: all of that), and a k past it is a 400 whatever the prompt's length. -1 without
    max_tokens is max_model_len, which leaves no room to generate: refused, as vLLM's get_max_tokens gives 0 and its
    SamplingParams refuses that. (-1 kept 127 tokens and generated one; k 100 ran beside max_tokens 50.)"""
    from tpgraph.engine.limits import RequestLimits

    class Checked(ScriptedClient):  # (refuses what the engine refuses, as the bridge checks it)
        def check(self, prompt, params) -> None:
            RequestLimits(vocab_size=1 << 20, max_model_len=128, cache_tokens=1 << 20).check(prompt, params)

    codec, client = builtin_codec(), Checked(["x"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    long_prompt = "word " * 500
    no_room, past, fits, completion = post_all(app, [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": long_prompt}],
                                  "truncate_prompt_tokens": -1}),
        ("/v1/completions", {"model": "m", "prompt": "x", "truncate_prompt_tokens": 100, "max_tokens": 50}),
        ("/v1/completions", {"model": "m", "prompt": long_prompt, "truncate_prompt_tokens": 78, "max_tokens": 50}),
        ("/v1/completions", {"model": "m", "prompt": long_prompt, "truncate_prompt_tokens": -1})])
    assert no_room.status_code == past.status_code == 400
    assert "leaves no room to generate" in no_room.json()["error"]["message"]
    assert "truncate_prompt_tokens must be between 1 and 78" in past.json()["error"]["message"]
    assert fits.status_code == completion.status_code == 200
    assert [len(p) for p in client.prompts] == [78, 128 - 16]  # (a completion's max_tokens defaults to 16)


def test_the_prompt_logprobs_field_gives_tied_tokens_their_top_k_places():
    """Two ids tied for the top: the prompt token's own rank counts the tie (2), and each top-k entry keeps its
    place (1 and 2), as vLLM's do; a negative count is a 400, not a slice."""
    from tpgraph.engine.updates import StepUpdate
    from tpgraph.errors import RequestError
    from tpgraph.server.protocol import CompletionRequest

    update = StepUpdate("r", 0, 7, "", prompt_logprobs=[(2, -1.0, [(1, -1.0), (2, -1.0)])], prompt_ranks=[2])
    field = server_app._prompt_logprobs_field(builtin_codec(), update, 2)
    assert field[0] is None and {t: e["rank"] for t, e in field[1].items()} == {"1": 1, "2": 2}
    with pytest.raises(RequestError, match="prompt_logprobs must be between 0 and 20"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "prompt_logprobs": -1}).sampling_params(4, None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_usage_says_how_many_prompt_tokens_were_cached_where_the_server_is_asked_to(path):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, summed over the prompts (each
    prompt's first sample's count), in the whole reply and in a stream's usage chunk; without it, no such field."""
    body = {"model": "m", "max_tokens": 2, "n": 2,
            **({"prompt": ["hi", "ho"]} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    prompts = 1 if "chat" in path else 2
    for details in (True, False):
        app = server_app.create_app(ScriptedClient(["a", "b"], cached=32), builtin_codec(), ServerMetrics(), "m", 128,
                                    prompt_tokens_details=details)
        whole, streamed = post_all(app, [(path, body), (path, {**body, "stream": True,
                                                               "stream_options": {"include_usage": True}})])
        usages = [whole.json()["usage"], sse_events(streamed.text)[-1]["usage"]]
        for usage in usages:
            assert usage.get("prompt_tokens_details") == ({"cached_tokens": 32 * prompts} if details else None)


@pytest.mark.parametrize(("path", "prefix"), [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
def test_a_clients_request_id_names_the_reply_and_comes_back_in_a_header_where_asked(path, prefix):
    """vLLM's X-Request-Id: the reply's id is the prefix and the client's id; with --enable-request-id-headers every
    response carries the header, the client's or one made for it, the same id the body names."""
    body = {"model": "m", "max_tokens": 2,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    for headers_on in (False, True):
        app = server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(), ServerMetrics(), "m", 128,
                                    request_id_headers=headers_on)
        whole, streamed = post_all(app, [(path, body), (path, {**body, "stream": True})], {"X-Request-Id": "trace-7"})
        assert whole.json()["id"] == prefix + "trace-7"
        assert {e["id"] for e in sse_events(streamed.text)} == {prefix + "trace-7"}
        assert [r.headers.get("x-request-id") for r in (whole, streamed)] == (["trace-7"] * 2 if headers_on
                                                                              else [None, None])
        (made,) = post_all(app, [(path, body)])
        assert made.json()["id"].startswith(prefix) and len(made.json()["id"]) == len(prefix) + 32
        assert made.headers.get("x-request-id") == (made.json()["id"].removeprefix(prefix) if headers_on else None)


@pytest.mark.parametrize(("path", "prefix"), [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
def test_the_bodys_request_id_names_the_reply_where_no_header_does(path, prefix):
    """vLLM's request_id body field (_base_request_id's default): the reply is `prefix + request_id` where no
    X-Request-Id header names it (the header wins), streamed or whole; with --enable-request-id-headers the response
    header carries the same id. It was ignored, and the reply named a new id."""
    body = {"model": "m", "max_tokens": 2, "request_id": "mine-3",
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    for headers_on in (False, True):
        app = server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(), ServerMetrics(), "m", 128,
                                    request_id_headers=headers_on)
        whole, streamed = post_all(app, [(path, body), (path, {**body, "stream": True})])
        assert whole.json()["id"] == prefix + "mine-3"
        assert {e["id"] for e in sse_events(streamed.text)} == {prefix + "mine-3"}
        assert [r.headers.get("x-request-id") for r in (whole, streamed)] == (["mine-3"] * 2 if headers_on
                                                                              else [None, None])
        (header,) = post_all(app, [(path, body)], {"X-Request-Id": "trace-7"})
        assert header.json()["id"] == prefix + "trace-7"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_id_that_is_no_unicode_text_is_a_400_not_a_500(path):
    """A body request_id with a lone surrogate (JSON's "\\ud800") named the whole reply, which cannot be written as
    UTF-8: the request ran, and its reply was a 500. It is refused up front, naming the field."""
    body = {"model": "m", "max_tokens": 2, "request_id": "id-\ud800",
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    client = ScriptedClient(["a", "b"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    (reply,) = post_all(app, [(path, body)])
    assert reply.status_code == 400 and "request_id" in reply.json()["error"]["message"]
    assert not client.prompts  # (refused before it reached the engine)


LONE = "x\ud800"  # (JSON's "\ud800" escape decodes to it: a string no UTF-8 encoder takes)


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", {"prompt": "hi", "user": LONE}, "user"),
    ("/v1/completions", {"prompt": ["hi", LONE]}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", LONE: 1}}}},
     "a key of response_format.json_schema.schema"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": LONE}}, "metadata.k"),
    ("/v1/messages", {"max_tokens": 2, "system": LONE, "messages": [{"role": "user", "content": "hi"}]}, "system"),
])
def test_a_body_holding_a_lone_surrogate_anywhere_is_a_400_naming_where(path, body, where):
    """One check for every field of every route: a lone surrogate in any string of a JSON body is a 400 that names
    where it is (under /v1/messages in Anthropic's error shape), and nothing reaches the engine. (A response's
    metadata, echoed back, made its reply unwritable: a 500 after the request ran.)"""
    client = ScriptedClient(["a", "b"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    (reply,) = post_all(app, [(path, {"model": "m", **body})])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"{where} is not valid Unicode text")
    assert error["type"] == ("invalid_request_error" if path == "/v1/messages" else "BadRequestError")
    assert not client.prompts



def test_the_lone_surrogate_check_looks_past_a_token_id_batch():
    """lm-eval sends its prompts as token ids, a batch at once: the body check passes over lists of numbers whole (no
    path for each id: its cost is bench/'s business, not a timed test's) and still finds a string after them, and one
    in a list that mixes numbers and strings."""
    from tpgraph.server.body_text import lone_surrogate_at

    body = {"model": "m", "prompt": [list(range(8000)) for _ in range(4)], "stop": ["a", LONE]}
    assert lone_surrogate_at(body) == "stop[1]"
    assert lone_surrogate_at({"prompt": [1, 2, "ok", 3, LONE]}) == "prompt[4]"
    assert lone_surrogate_at({"prompt": [list(range(100)), [1, 2]]}) is None


def _tokens_every_10_ms(monkeypatch, samples: int, last: str | None, end_s: float, reason: str):
    """Each sample gets a token every 10 ms for 50 ms (the last update says `last`); the request ends at end_s. The
    metrics' registry."""
    from tpgraph.engine.updates import StepUpdate
    from tpgraph.server import metrics as server_metrics

    monkeypatch.setattr(server_metrics.time, "perf_counter", lambda: 0.0)  # (the arrival)
    metrics = ServerMetrics()
    metrics.arrived("r", 4, samples)
    for step in range(1, 6):
        for sample in range(samples):
            metrics.observe(StepUpdate("r", sample, 7, "x", last if step == 5 else None), step * 0.01)
    metrics.finished("r", reason, end_s)
    return metrics.registry


def test_time_per_output_token_is_a_samples_not_the_requests_tokens_pooled(monkeypatch):
    """n = 2 samples each get a token every 10 ms: TPOT is 10 ms. The tokens of all samples were counted as one
    sequence's, which made it 10 ms / n (4.4 ms here)."""
    registry = _tokens_every_10_ms(monkeypatch, 2, "length", 0.05, "length")
    assert registry.get_sample_value("vllm:request_time_per_output_token_seconds_count", LABELS) == 2
    assert registry.get_sample_value("vllm:request_time_per_output_token_seconds_sum", LABELS) == pytest.approx(0.02)


def test_inter_token_latency_is_each_gap_between_a_samples_tokens(monkeypatch):
    """vLLM's vllm:inter_token_latency_seconds (beside its per-request mean, request_time_per_output_token): one
    observation per token after a sample's first, the time since that sample's previous token. n = 2 samples each get
    a token every 10 ms: 2 x 4 gaps of 10 ms. It was not exported, so a dashboard's ITL panel built on vLLM's was
    empty."""
    registry = _tokens_every_10_ms(monkeypatch, 2, "length", 0.05, "length")
    assert registry.get_sample_value("vllm:inter_token_latency_seconds_count", LABELS) == 8
    assert registry.get_sample_value("vllm:inter_token_latency_seconds_sum", LABELS) == pytest.approx(0.08)


def test_each_samples_prompt_and_generation_lengths_are_histograms_as_vllms(monkeypatch):
    """vLLM's vllm:request_prompt_tokens and vllm:request_generation_tokens (its dashboard's prompt and generation
    length heatmaps): each finished sample's prompt length and tokens generated, in 1-2-5 buckets up to max_model_len.
    They were not exported. n = 2 samples of a 4-token prompt, 5 tokens each."""
    registry = _tokens_every_10_ms(monkeypatch, 2, "length", 0.05, "length")
    get = registry.get_sample_value
    assert (get("vllm:request_prompt_tokens_count", LABELS), get("vllm:request_prompt_tokens_sum", LABELS)) == (2, 8)
    assert get("vllm:request_generation_tokens_count", LABELS) == 2
    assert get("vllm:request_generation_tokens_sum", LABELS) == 10
    assert get("vllm:request_generation_tokens_bucket", {**LABELS, "le": "5.0"}) == 2
    assert get("vllm:request_generation_tokens_bucket", {**LABELS, "le": "2.0"}) == 0
    bounds = [s.labels["le"] for m in ServerMetrics(max_model_len=600).registry.collect()
              if m.name == "vllm:request_prompt_tokens" for s in m.samples if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]


def test_each_of_n_samples_is_counted_as_vllm_counts_its_requests(monkeypatch):
    """vLLM's engine runs each of n samples as a request of its own: TTFT, TPOT, end-to-end latency and the finished
    count are each sample's, a sample that ended on its own under its own reason, the ones the request's end cut
    off under that end's (an abort). They were the request's, once."""
    from tpgraph.engine.updates import StepUpdate
    from tpgraph.server import metrics as server_metrics

    monkeypatch.setattr(server_metrics.time, "perf_counter", lambda: 0.0)
    metrics = ServerMetrics()
    metrics.arrived("r", 4, 3)
    metrics.observe(StepUpdate("r", 0, 7, "x"), 0.01)  # (sample 0: tokens at 10 and 30 ms, then a stop)
    metrics.observe(StepUpdate("r", 1, 7, "x"), 0.02)  # (sample 1: one token at 20 ms, then cut off)
    metrics.observe(StepUpdate("r", 0, 7, "x", "stop"), 0.03)
    metrics.finished("r", "abort", 0.5)  # (sample 2 never had a token)
    get = metrics.registry.get_sample_value
    assert get("vllm:time_to_first_token_seconds_count", LABELS) == 2
    assert get("vllm:time_to_first_token_seconds_sum", LABELS) == pytest.approx(0.03)
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": "stop"}) == 1
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": "abort"}) == 2
    assert get("vllm:e2e_request_latency_seconds_count", LABELS) == 3
    assert get("vllm:e2e_request_latency_seconds_sum", LABELS) == pytest.approx(0.03 + 0.5 + 0.5)
    assert get("vllm:request_time_per_output_token_seconds_count", LABELS) == 1  # (sample 0's 20 ms)
    assert get("vllm:prompt_tokens_total", LABELS) == 8  # (two samples computed the prompt)


def test_time_per_output_token_ends_at_the_last_token_not_at_the_requests_end(monkeypatch):
    """A sample gets a token every 10 ms, then sits (preempted, or its client gone and not yet noticed) until it is
    aborted a second later: TPOT is 10 ms, as vLLM's (first to last token). It ran to the request's end, which put
    the wait into every token (250 ms here)."""
    registry = _tokens_every_10_ms(monkeypatch, 1, None, 1.05, "abort")
    assert registry.get_sample_value("vllm:request_time_per_output_token_seconds_sum", LABELS) == pytest.approx(0.01)
    assert registry.get_sample_value("vllm:e2e_request_latency_seconds_sum", LABELS) == pytest.approx(1.05)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_that_names_no_model_gets_the_one_served(path):
    """As vLLM's server: `model` may be left out, null or empty (vLLM's _is_model_supported takes any falsy name as
    the served model's); another model's name is still a 404."""
    body = {"max_tokens": 2, **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user",
                                                                                          "content": "hi"}]})}
    app = server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(), ServerMetrics(), "m", 128)
    left_out, null, empty, other = post_all(app, [(path, body), (path, {**body, "model": None}),
                                                  (path, {**body, "model": ""}), (path, {**body, "model": "gpt-4"})])
    assert left_out.status_code == null.status_code == empty.status_code == 200
    assert left_out.json()["model"] == null.json()["model"] == empty.json()["model"] == "m"
    assert other.status_code == 404 and "`gpt-4` does not exist" in other.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stuck_send", [1, 3], ids=["at-the-headers", "mid-stream"])
def test_a_streaming_client_that_leaves_while_a_send_waits_has_its_request_aborted(path, stuck_send):
    """A slow reader: a send waits (the socket's buffer is full) when the client goes away, and the response is
    cancelled with the stream's generators suspended. Nothing closed them: their request ran on, holding its KV
    blocks, until the garbage collector got to them (never, here: it is off, as a collection of old objects may be
    minutes away)."""
    import gc

    from tpgtest.server_stubs import leave_mid_request

    client = EndlessClient()
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    body = json.dumps({"model": "m", "max_tokens": 1000, "stream": True,
                       **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user",
                                                                                     "content": "hi"}]})}).encode()
    gc.disable()
    try:
        took, sent = leave_mid_request(app, client, path, body, [], stuck_send=stuck_send)
    finally:
        gc.enable()
    assert len(sent) == stuck_send and len(client.aborted) == 1 and took < 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_whole_reply_that_fails_while_it_is_folded_aborts_its_request(path, monkeypatch):
    """A bug that raises while a non-streamed reply folds its updates ends its engine request at once, not left
    running (holding its KV blocks) until the garbage collector, or the loop's end, closes the suspended stream."""
    import gc

    calls = []

    def failing_add(self, u):
        calls.append(u)
        if len(calls) == 3:
            raise RuntimeError("a bug")
        return self

    monkeypatch.setattr(server_app.Choice, "add", failing_add)
    client = EndlessClient()
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    body = {"model": "m", "max_tokens": 1000,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    httpx = httpx_module()

    async def main() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            with pytest.raises(RuntimeError, match="a bug"):  # (the in-process transport raises what the app raised)
                await http.post(path, json=body)
            aborted = list(client.aborted)  # (before the loop ends: its end closes suspended generators too)
        for t in client.tasks:
            t.cancel()
        return aborted

    gc.disable()
    try:
        aborted = asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        gc.enable()
    assert len(aborted) == 1


def test_generation_configs_max_new_tokens_limits_a_request_that_sets_none():
    """As vLLM's server: a chat request without max_tokens is limited to generation_config.json's max_new_tokens; one
    that sets a smaller one keeps it (a completion's null max_tokens is its default, 16, as vLLM's)."""
    from dataclasses import replace

    client = ScriptedClient(["a"])
    codec = builtin_codec()
    codec = replace(codec, generation_defaults=replace(codec.generation_defaults, max_tokens=64))
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    post_all(app, [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "max_tokens": 5}),
                   ("/v1/chat/completions", {**chat, "max_completion_tokens": 6}),
                   ("/v1/completions", {"prompt": "hi", "max_tokens": None}), ("/v1/completions", {"prompt": "hi"})])
    assert [p.max_tokens for p in client.params] == [64, 5, 6, 16, 16]


def test_generation_configs_max_new_tokens_limits_a_request_that_sets_more_as_vllms_server_wide_limit():
    """vLLM's --generation-config: max_new_tokens "sets a server-wide limit on the number of output tokens for all
    requests" (get_max_tokens takes the least of it and the request's own): a chat or completion asking more gets that
    limit (it ran the request's own 100 tokens); one asking less keeps its own; one asking past the context's room is
    still refused by the engine, as vLLM refuses it (left as asked)."""
    from dataclasses import replace

    client = ScriptedClient(["a"])
    codec = builtin_codec()
    codec = replace(codec, generation_defaults=replace(codec.generation_defaults, max_tokens=64))
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    post_all(app, [("/v1/chat/completions", {**chat, "max_tokens": 100}),
                   ("/v1/chat/completions", {**chat, "max_completion_tokens": 70}),
                   ("/v1/completions", {"prompt": "hi", "max_tokens": 100}),
                   ("/v1/completions", {"prompt": "hi", "max_tokens": 63}),
                   ("/v1/completions", {"prompt": "hi", "max_tokens": 127})])
    assert [p.max_tokens for p in client.params] == [64, 64, 64, 63, 127]


def test_generation_configs_max_new_tokens_is_cut_to_the_room_the_prompt_leaves():
    """As vLLM's server: the default limit is at most what the context leaves beside the (longest) prompt, so a
    request that set none is not refused for a limit it never asked for; a limit the client sets past that room is
    left as asked, for the engine to refuse."""
    from dataclasses import replace

    client = ScriptedClient(["a"])
    codec = builtin_codec()
    codec = replace(codec, generation_defaults=replace(codec.generation_defaults, max_tokens=64))
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "x" * 90}]}
    post_all(app, [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "max_tokens": 100})])
    lens = [len(p) for p in client.prompts]
    assert lens[0] > 64 and lens[0] == lens[1]
    assert [p.max_tokens for p in client.params] == [128 - lens[0], 100]


def test_queue_time_is_observed_once_per_sample_from_its_first_update():
    from tpgraph.engine.updates import StepUpdate

    metrics = ServerMetrics()
    metrics.arrived("r", 3)
    for sample, queued in ((0, 0.25), (1, 0.5)):
        metrics.observe(StepUpdate("r", sample, 7, "x", queue_s=queued))
        metrics.observe(StepUpdate("r", sample, 8, "y"))
    get = metrics.registry.get_sample_value
    assert get("vllm:request_queue_time_seconds_count", LABELS) == 2
    assert get("vllm:request_queue_time_seconds_sum", LABELS) == 0.75


def test_a_slow_reader_does_not_stretch_the_latencies_the_engine_delivered():
    """The engine delivers every token at once; the reader (a slow streaming client) takes one each 50 ms. The
    latencies are those of the delivery, as vLLM's engine-side timestamps give them: they were taken as the reader
    took each update, so TPOT read 50 ms and e2e 150 ms."""
    metrics = ServerMetrics()

    async def main() -> None:
        async for _ in server_app.Api(ScriptedClient(["a", "b", "c", "d"]), metrics, "m").run(
                LeavingRequest(after=60), [[1, 2]], SamplingParams(max_tokens=4)):
            await asyncio.sleep(0.05)

    asyncio.run(main())
    get = metrics.registry.get_sample_value
    assert get("vllm:request_time_per_output_token_seconds_count", LABELS) == 1
    assert get("vllm:request_time_per_output_token_seconds_sum", LABELS) < 0.01
    assert get("vllm:e2e_request_latency_seconds_sum", LABELS) < 0.04



class RefusingSecondClient(ScriptedClient):
    """The first prompt's tokens (unfinished), then the engine's refusal of the second prompt."""

    def submit(self, request_id, prompt, params, sink) -> None:
        if self.prompts:
            sink(StepUpdate(request_id, 0, None, "a bad request", REFUSED))
        else:
            super().submit(request_id, prompt, params, sink)


def test_a_completions_stream_whose_later_prompt_the_engine_refuses_ends_with_an_error_event_and_done():
    """The engine refuses a completion's second prompt after the first's tokens streamed (the 200 is sent): vLLM's
    completion_stream_generator sends the error as an event (a ValueError as a 400 BadRequestError) and [DONE]. The
    RequestError went through the stream here: the connection was cut, with neither."""
    app = server_app.create_app(RefusingSecondClient(["a", "b", "c"], finish=None), builtin_codec(), ServerMetrics(),
                                "m", 128)
    reply, = post_all(app, [("/v1/completions", {"model": "m", "prompt": ["x", "y"], "stream": True,
                                                 "max_tokens": 4})])
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    events = sse_events(reply.text)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b", "c"]
    assert events[-1] == {"error": {"message": "a bad request", "type": "BadRequestError", "param": None, "code": 400}}


@pytest.mark.parametrize("client,prompts,finish", [
    (ScriptedClient(["a", "b", "c", ""], finish="error"), [[1, 2]], "error"),
    (RefusingSecondClient(["a", "b", "c"], finish=None), [[1, 2], [3]], REFUSED)], ids=["error", "refused"])
def test_requests_an_update_ended_are_timed_at_its_delivery_not_as_a_slow_reader_took_it(client, prompts, finish):
    """The engine delivers three tokens, then fails the request (or refuses the next prompt); the reader takes one
    each 50 ms. The requests' end was timed as the reader took that update: e2e read 150 ms, not the delivery's."""
    metrics = ServerMetrics()

    async def main() -> None:
        async for _ in server_app.Api(client, metrics, "m").run(LeavingRequest(after=60), prompts,
                                                                 SamplingParams(max_tokens=4)):
            await asyncio.sleep(0.05)

    with pytest.raises((server_app.ApiError, RequestError)):
        asyncio.run(main())
    get = metrics.registry.get_sample_value
    if finish == REFUSED:  # (refused requests are counted as such alone, never timed: vLLM's engine never sees one)
        assert get("tpgraph_requests_refused_total") == len(prompts)
        assert get("vllm:e2e_request_latency_seconds_count", LABELS) == 0
        return
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": finish}) == len(prompts)
    assert get("vllm:e2e_request_latency_seconds_count", LABELS) == len(prompts)
    assert get("vllm:e2e_request_latency_seconds_sum", LABELS) < 0.02 * len(prompts)


def test_a_plain_chat_streams_content_in_its_finish_chunk_as_vllms():
    """vLLM's chat stream without a reasoning or tool parser sends each chunk's delta as DeltaMessage(content=text),
    the finish chunk's too: {"content": ""} where the last token (an EOS) adds no text. Here that chunk's delta was
    {}, so a client that joins delta.content read None from it."""
    app = server_app.create_app(ScriptedClient(["a", ""]), builtin_codec(), ServerMetrics(), "m", 128)
    body = {"model": "m", "stream": True, "n": 2, "messages": [{"role": "user", "content": "hi"}]}
    chunks = [c["choices"][0] for c in sse_events(post_all(app, [("/v1/chat/completions", body)])[0].text)]
    finish = [c for c in chunks if c["finish_reason"] is not None]
    assert [(c["index"], c["delta"], c["finish_reason"]) for c in finish] == [(0, {"content": ""}, "stop"),
                                                                               (1, {"content": ""}, "stop")]
    assert all(isinstance(c["delta"]["content"], str) for c in chunks)


def test_a_chats_echo_puts_the_last_message_before_a_reply_in_its_role():
    """vLLM's chat `echo`: where the reply is in the last message's role (continuing it, add_generation_prompt
    false), that message's text comes first, in the whole message and as a stream's first content; a reply in
    another role has nothing echoed. It was taken and ignored."""
    app = server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(), ServerMetrics(), "m", 128)
    body = {"model": "m", "max_tokens": 2, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True, "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "Sure, "}]}
    other = {**body, "add_generation_prompt": True, "continue_final_message": False,
             "messages": [{"role": "user", "content": "hi"}]}
    whole, streamed, elsewhere = post_all(app, [("/v1/chat/completions", body),
                                                ("/v1/chat/completions", {**body, "stream": True, "n": 2}),
                                                ("/v1/chat/completions", other)])
    assert whole.json()["choices"][0]["message"]["content"] == "Sure, ab"
    chunks = [c["choices"][0] for c in sse_events(streamed.text)]
    for index in (0, 1):
        deltas = [c["delta"] for c in chunks if c["index"] == index]
        assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "Sure, "}
        assert "".join(d.get("content", "") for d in deltas) == "Sure, ab"
    assert elsewhere.json()["choices"][0]["message"]["content"] == "ab"



def test_a_chats_echo_in_the_openai_content_format_keeps_empty_text_parts():
    """vLLM's chat echo joins the last message's parts as its parser gives them by newlines; in the "openai" content
    format an empty text part is kept there (a {"type": "text"} object), so ["a", "", "b"] echoes "a\\n\\nb". The
    empty part was dropped here ("a\\nb")."""
    app = server_app.create_app(ScriptedClient(["x"]), builtin_codec(), ServerMetrics(), "m", 128,
                                http=HttpOptions(chat_template_content_format="openai"))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]
    body = {"model": "m", "max_tokens": 1, "echo": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": parts}]}
    (whole,) = post_all(app, [("/v1/chat/completions", body)])
    assert whole.json()["choices"][0]["message"]["content"] == "a\n\nbx"


def test_a_chats_echo_fills_its_prompt_logprobs_as_vllms():
    """vLLM's chat runs an echo as prompt_logprobs of its top_logprobs (0 without logprobs; its own prompt_logprobs
    where given), and the whole reply's prompt_logprobs field gives them; a stream's reply has no such field, so a
    streamed echo computes none. It was null with echo."""

    class PromptScoringClient(ScriptedClient):
        def submit(self, request_id, prompt, params, sink) -> None:
            self.params.append(params)
            first = StepUpdate(request_id, 0, 7, "a", "length")
            if params.prompt_logprobs is not None:  # (as the engine: only where asked)
                first.prompt_logprobs = [(t, -1.0, [(t, -1.0)][:params.prompt_logprobs]) for t in prompt[1:]]
                first.prompt_ranks = [1] * (len(prompt) - 1)
            sink(first)

    client = PromptScoringClient(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    body = {"model": "m", "max_tokens": 1, "echo": True, "messages": [{"role": "user", "content": "hi"}]}
    plain, top, own, streamed, no_echo = post_all(app, [
        ("/v1/chat/completions", body), ("/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {**body, "prompt_logprobs": 1}), ("/v1/chat/completions", {**body, "stream": True}),
        ("/v1/chat/completions", {**body, "echo": False})])
    assert [p.prompt_logprobs for p in client.params] == [0, 2, 1, None, None]
    for reply in (plain, top, own):
        field = reply.json()["prompt_logprobs"]
        assert field[0] is None and len(field) == reply.json()["usage"]["prompt_tokens"]
        assert all(entry[next(iter(entry))]["logprob"] == -1.0 for entry in field[1:])
    assert streamed.status_code == 200 and no_echo.json()["prompt_logprobs"] is None

def test_add_special_tokens_says_whether_the_prompt_gets_a_bos():
    """vLLM's add_special_tokens: a completion's prompt text gets the tokenizer's special tokens (BOS) unless it is
    false; a chat's gets none beside the template's unless it is true. It was ignored on both."""
    codec, client = builtin_codec(), ScriptedClient(["a"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    post_all(app, [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                   ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "add_special_tokens": False}),
                   ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "add_special_tokens": True})])
    text, chat_text = codec.encode_text("hi"), codec.render_chat(chat["messages"])
    assert client.prompts[:2] == [text, codec.encode_text("hi", add_special_tokens=False)] and text != client.prompts[1]
    assert client.prompts[2:] == [codec.encode_chat(chat_text), codec.encode_text(chat_text)]
    assert client.prompts[2] != client.prompts[3]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_gives_the_prompts_and_each_choices_ids(path):
    """vLLM's return_token_ids: a whole reply gives each choice's token_ids and the prompt's ids (a completion choice's
    prompt_token_ids; a chat reply's, beside its choices); a stream gives each chunk its new ids and the prompt's ids
    with a choice's first chunk (a chat stream, with its role chunk). It was taken and ignored."""
    codec, client = builtin_codec(), ScriptedClient(["a", "b"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    chat = "chat" in path
    body = {"model": "m", "max_tokens": 2, "n": 2, "return_token_ids": True,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    whole, streamed, plain = post_all(app, [(path, body), (path, {**body, "stream": True}),
                                            (path, {**body, "return_token_ids": False})])
    prompt = client.prompts[0]
    reply = whole.json()
    assert [c["token_ids"] for c in reply["choices"]] == [[7, 7], [7, 7]]
    if chat:
        assert reply["prompt_token_ids"] == prompt
    else:
        assert [c["prompt_token_ids"] for c in reply["choices"]] == [prompt, prompt]
    chunks = sse_events(streamed.text)
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        where = [c if chat else c["choices"][0] for c in mine]
        assert where[0]["prompt_token_ids"] == prompt and all(w.get("prompt_token_ids") is None for w in where[1:])
        assert [t for c in mine for t in c["choices"][0].get("token_ids") or []] == [7, 7]
    assert all(c.get("token_ids") is None for c in plain.json()["choices"])
    assert all(c.get("prompt_token_ids") is None for c in [plain.json(), *plain.json()["choices"]])
    # a reasoning server that leaves the thoughts out leaves their ids out too (vLLM's hide_stream_metadata)
    from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS

    if chat:
        app = server_app.create_app(ScriptedClient(["think", "</think>", "ok"]), codec, ServerMetrics(), "m", 128,
                                    reasoning=REASONING_PARSERS["deepseek_r1"])
        hidden, hidden_stream = post_all(app, [(path, {**body, "include_reasoning": False}),
                                               (path, {**body, "include_reasoning": False, "stream": True})])
        assert all("token_ids" in c and c["token_ids"] is None for c in hidden.json()["choices"])
        assert not [c for c in sse_events(hidden_stream.text) if c["choices"] and c["choices"][0].get("token_ids")]


def test_hidden_thoughts_send_no_log_probabilities():
    """include_reasoning false on a reasoning server leaves the thoughts out; their tokens' log-probabilities (each
    entry names its token) still showed them, in the whole reply and in the stream. vLLM suppresses a choice's
    logprobs there (suppress_metadata / hide_stream_metadata); now the same."""
    from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS

    app = server_app.create_app(ScriptedClient(["Secret", "</think>", "ok"]), builtin_codec(), ServerMetrics(), "m",
                                128, reasoning=REASONING_PARSERS["deepseek_r1"])
    body = {"model": "m", "max_tokens": 3, "logprobs": True, "top_logprobs": 1, "include_reasoning": False,
            "messages": [{"role": "user", "content": "hi"}]}
    whole, streamed, shown = post_all(app, [("/v1/chat/completions", body),
                                            ("/v1/chat/completions", {**body, "stream": True}),
                                            ("/v1/chat/completions", {**body, "include_reasoning": True})])
    assert whole.json()["choices"][0]["logprobs"] is None
    assert whole.json()["choices"][0]["message"]["content"] == "ok"
    chunks = sse_events(streamed.text)
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "ok"
    assert len(shown.json()["choices"][0]["logprobs"]["content"]) == 3  # (shown thoughts keep theirs)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_whole_reply_carries_vllms_fields_null_where_unset(path):
    """vLLM's whole replies are its response models dumped with every field: system_fingerprint, service_tier and
    kv_transfer_params null, a completion choice's prompt_logprobs and a chat reply's null where not asked, a chat
    message's refusal, annotations, audio, function_call and reasoning null. A client that reads one as a key (a
    dict's ["system_fingerprint"]) got a KeyError here; OpenAI's SDK reads a vLLM extra such as prompt_logprobs
    as an attribute only where the key is there."""
    app = server_app.create_app(ScriptedClient(["a", "b"]), builtin_codec(), ServerMetrics(), "m", 128)
    chat = "chat" in path
    body = {"model": "m", "max_tokens": 2,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    (reply,) = post_all(app, [(path, body)])
    reply = reply.json()
    for key in ("system_fingerprint", "service_tier", "kv_transfer_params"):
        assert key in reply and reply[key] is None, key
    if chat:
        assert "prompt_logprobs" in reply and reply["prompt_logprobs"] is None
        message = reply["choices"][0]["message"]
        assert message["content"] == "ab" and "tool_calls" not in message  # (vLLM drops an empty list)
        for key in ("refusal", "annotations", "audio", "function_call", "reasoning"):
            assert key in message and message[key] is None, key
    else:
        assert "prompt_logprobs" in reply["choices"][0] and reply["choices"][0]["prompt_logprobs"] is None


def test_an_echo_with_logprobs_fills_each_choices_prompt_logprobs():
    """vLLM runs an echo with logprobs k as prompt_logprobs k, and its choices' prompt_logprobs field gives them."""

    class PromptScoringClient(ScriptedClient):
        def submit(self, request_id, prompt, params, sink) -> None:
            first = StepUpdate(request_id, 0, 7, "a", "length", logprob=-0.5, top_logprobs=[(7, -0.5)],
                               prompt_logprobs=[(t, -1.0, [(t, -1.0)]) for t in prompt[1:]],
                               prompt_ranks=[1] * (len(prompt) - 1))
            sink(first)

    app = server_app.create_app(PromptScoringClient(["a"]), builtin_codec(), ServerMetrics(), "m", 128)
    (reply,) = post_all(app, [("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "echo": True,
                                                   "logprobs": 1})])
    choice = reply.json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == reply.json()["usage"][
        "prompt_tokens"]
    assert all(entry[next(iter(entry))]["logprob"] == -1.0 for entry in choice["prompt_logprobs"][1:])


def test_a_completions_null_max_tokens_is_its_default_16():
    """vLLM's CompletionRequest.normalize_null_max_tokens (vllm#45491): "max_tokens": null on /v1/completions is the
    field's default, 16 (OpenAI's SDK sends null for a value left unset), not a limit left to the context; it ran up
    to max_model_len here. Chat's null stays no limit of its own, as vLLM's."""
    client = ScriptedClient(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    post_all(app, [("/v1/completions", {"prompt": "hi", "max_tokens": None}),
                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None})])
    assert [p.max_tokens for p in client.params] == [16, None]


def test_a_chats_documents_reach_the_chat_template():
    """vLLM's chat request field documents (RAG templates' sources, each {"title", "text"}) is given to the chat
    template as its `documents`, as apply_chat_template takes them. It was taken and ignored: the template saw none."""
    import dataclasses

    from tpgraph.chat import ChatTemplate

    template = ChatTemplate("{{ bos_token }}{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}", {"bos_token": BOS})
    codec, client = dataclasses.replace(builtin_codec(), chat_template=template), ScriptedClient(["a"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    docs = [{"title": "Peru", "text": "Lima"}, {"title": "Chile", "text": "Santiago"}]
    given, none, bad = post_all(app, [("/v1/chat/completions", {**chat, "documents": docs}),
                                      ("/v1/chat/completions", chat),
                                      ("/v1/chat/completions", {**chat, "documents": "Lima"})])
    assert given.status_code == 200 and none.status_code == 200 and bad.status_code == 400
    assert client.prompts == [codec.encode_chat(f"{BOS}[Peru: Lima][Chile: Santiago]hi"), codec.encode_chat(f"{BOS}hi")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_token_a_grammar_rules_out_has_a_json_log_probability_as_vllms(path):
    """Under a structured output the log-probabilities are over what the grammar allows (the sampler masks the logits
    first), so an alternative it rules out has -inf, which JSON cannot write: the whole reply was a 500 (the response's
    json.dumps refuses it) and a stream's event held `-Infinity`, which a client's JSON parser refuses. vLLM's server
    writes such a log-probability as -9999.0, in both endpoints' logprobs."""

    class MaskedClient(ScriptedClient):
        def submit(self, request_id, prompt, params, sink) -> None:
            self.params.append(params)
            sink(StepUpdate(request_id, 0, 7, "a", "stop", logprob=0.0,
                            top_logprobs=[(7, 0.0), (8, float("-inf"))][:params.logprobs]))

    def strict(text: str):  # (json.loads takes NaN and Infinity, which JSON has not)
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    chat = "chat" in path
    body = {"model": "m", "max_tokens": 1, **({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                               "top_logprobs": 2} if chat else {"prompt": "hi", "logprobs": 2})}
    app = server_app.create_app(MaskedClient(["a"]), builtin_codec(), ServerMetrics(), "m", 128)
    whole, streamed = post_all(app, [(path, body), (path, {**body, "stream": True})])
    assert whole.status_code == streamed.status_code == 200, whole.text
    events = [strict(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    (chunk,) = [e for e in events if e["choices"] and e["choices"][0]["logprobs"]]  # (a chat's role chunk has none)
    for choice in [strict(whole.text)["choices"][0], chunk["choices"][0]]:
        if chat:
            assert [e["logprob"] for e in choice["logprobs"]["content"][0]["top_logprobs"]] == [0.0, -9999.0]
        else:
            assert list(choice["logprobs"]["top_logprobs"][0].values()) == [0.0, -9999.0]


@pytest.mark.parametrize(("path", "prefix"), [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
def test_a_refused_requests_400_names_the_bodys_request_id_in_its_header(path, prefix):
    """With --enable-request-id-headers, a request the engine refuses as it is submitted answers 400 with the
    X-Request-Id its body's request_id names, as a request that runs does."""

    class Refusing(ScriptedClient):
        def check(self, prompt, params) -> None:
            raise RequestError("the prompt is too long")

    body = {"model": "m", "max_tokens": 2, "request_id": "mine-4",
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    app = server_app.create_app(Refusing(["a"]), builtin_codec(), ServerMetrics(), "m", 128, request_id_headers=True)
    (refused,) = post_all(app, [(path, body)])
    assert refused.status_code == 400 and refused.headers.get("x-request-id") == "mine-4"


def test_a_cancelled_request_loop_ends_though_updates_keep_coming():
    """A background response's cancel cancels the task running Api.run while its engine sends a token every 5 ms.
    asyncio.wait_for (Python 3.11) swallowed a cancel that came as its get finished, so the loop ran on and the
    cancel waited for good (about one cancel in two hung)."""
    async def trial() -> bool:
        client = EndlessClient()
        api = server_app.Api(client, ServerMetrics(), "m")

        async def consume() -> None:
            async for _ in api.run(LeavingRequest(after=60), [[1, 2]], SamplingParams(max_tokens=10_000)):
                pass

        task = asyncio.get_running_loop().create_task(consume())
        await asyncio.sleep(0.03)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        for t in client.tasks:
            t.cancel()
        return bool(done) and client.aborted != []

    async def main() -> list[bool]:
        return [await trial() for _ in range(20)]

    assert all(asyncio.run(main()))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bad", [{"temperature": 5}, {"model": "other"}, {"truncate_prompt_tokens": 0}])
def test_a_request_refused_by_its_checks_names_the_bodys_request_id_in_its_header(path, bad):
    """With --enable-request-id-headers, a completion refused by the server's own checks (a field out of range, an
    unknown model, ...) answered with a fresh X-Request-Id, not its body's request_id: the completions route took the
    id only after tokenizing and reading the sampling fields. The chat route names it first, and so does it now."""
    body = {"model": "m", "max_tokens": 2, "request_id": "mine-5", **bad,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    app = server_app.create_app(ScriptedClient(["a"]), builtin_codec(), ServerMetrics(), "m", 128,
                                request_id_headers=True)
    (refused,) = post_all(app, [(path, body)])
    assert refused.status_code in (400, 404) and refused.headers.get("x-request-id") == "mine-5"


def test_a_bad_word_that_is_no_unicode_text_is_a_400_not_the_engines_500():
    """bad_words are tokenized as the engine prepares the request (EngineService._collect, as this client does): one
    with a lone surrogate (JSON's "\\ud800") failed the tokenizer there ("TextInputSequence must be str"), and the
    client got the engine's 500. It is refused up front, naming the field."""
    from tpgraph.engine.bad_words import encode_bad_words

    class Preparing(ScriptedClient):
        def submit(self, request_id, prompt, params, sink) -> None:
            try:
                encode_bad_words(builtin_codec().tokenizer, params.bad_words, 258)
            except Exception as exc:  # noqa: BLE001 - as the engine service answers a request it cannot prepare
                sink(StepUpdate(request_id, 0, None, str(exc), "error"))
                return
            super().submit(request_id, prompt, params, sink)

    client = Preparing(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    (reply,) = post_all(app, [("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2,
                                                   "bad_words": ["ok", "x\ud800"]})])
    assert reply.status_code == 400 and "bad_words" in reply.json()["error"]["message"]


def test_a_requests_cache_salt_reaches_the_engine_on_every_route_and_an_empty_one_is_a_400():
    """vLLM's cache_salt (completions, chat, Responses; the Messages API as a sampling extra): the request's params
    carry it to the prefix cache, which shares its blocks only with its salt's; an empty salt is a 400."""
    client = ScriptedClient(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    replies = post_all(app, [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "cache_salt": "t1"}),
        ("/v1/chat/completions", {**chat, "cache_salt": "t2"}),
        ("/v1/chat/completions", chat),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "cache_salt": "t3"}),
        ("/v1/messages", {**chat, "cache_salt": "t4"})])
    assert [r.status_code for r in replies] == [200] * 5
    assert [p.cache_salt for p in client.params] == ["t1", "t2", None, "t3", "t4"]
    bad = post_all(app, [("/v1/chat/completions", {**chat, "cache_salt": ""})])[0]
    assert bad.status_code == 400 and "cache_salt must be a non-empty string" in bad.json()["error"]["message"]
    assert len(client.params) == 5


def test_a_json_schema_nested_past_the_limit_is_a_400_before_any_grammar_compiles():
    """A schema nested some hundreds of levels deep (a 30 KB body) took xgrammar minutes to convert and compile, on
    the one thread that compiles every request's grammar: each constrained request of every client waited behind it.
    It is refused when the request is read, naming the limit; one at the limit is taken."""
    from tpgraph.engine.structured import MAX_SCHEMA_DEPTH

    def nested(levels: int) -> dict:  # (each array schema one level of the JSON text)
        schema: dict = {"type": "string"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    client = ScriptedClient(["[]"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deep, at_limit = post_all(app, [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": nested(500)}}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": nested(MAX_SCHEMA_DEPTH)})])
    assert deep.status_code == 400, deep.text
    assert f"more than {MAX_SCHEMA_DEPTH} levels deep" in deep.json()["error"]["message"]
    assert at_limit.status_code == 200 and len(client.params) == 1


def test_a_choice_or_enum_past_the_limit_is_a_400_before_any_grammar_compiles():
    """A guided_choice of 100,000 strings (a 1 MB body) took xgrammar 48 s to compile, as long an enum of a JSON
    schema, on the one thread that compiles every request's grammar. Either is refused when the request is read;
    one at the limit is taken."""
    from tpgraph.engine.structured import MAX_CHOICES

    client = ScriptedClient(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    many = [f"v{i}" for i in range(MAX_CHOICES + 1)]
    choice, enum, at_limit = post_all(app, [
        ("/v1/chat/completions", {**chat, "guided_choice": many}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": {
            "type": "object", "properties": {"k": {"enum": many}}}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_choice": many[:MAX_CHOICES]})])
    assert choice.status_code == enum.status_code == 400
    assert f"offers {MAX_CHOICES + 1} strings; at most {MAX_CHOICES}" in choice.json()["error"]["message"]
    assert f"an enum of {MAX_CHOICES + 1} values; at most {MAX_CHOICES}" in enum.json()["error"]["message"]
    assert at_limit.status_code == 200 and len(client.params) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_a_stop_string_past_the_length_limit_is_a_400_and_one_at_it_is_taken(path):
    """A stop string's automaton is built on the engine's thread as the request is taken, a table as long as the
    string for each sample: a hundred stop strings of 100,000 characters (a 10 MB body) held every request for
    seconds and took gigabytes. Each may be as long as a bad word (1000 characters), as the Messages API's
    stop_sequences."""
    from tpgraph.engine.sampling_params import MAX_STOP_STRING_CHARS

    client = ScriptedClient(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    name = "stop_sequences" if path == "/v1/messages" else "stop"
    body = {"max_tokens": 2, **({"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]})}
    long, at_limit = post_all(app, [(path, {**body, name: ["x", "y" * (MAX_STOP_STRING_CHARS + 1)]}),
                                    (path, {**body, name: ["y" * MAX_STOP_STRING_CHARS]})])
    assert long.status_code == 400, long.text
    message = long.text
    assert f"a string of {MAX_STOP_STRING_CHARS + 1} characters" in message and name in message
    assert at_limit.status_code == 200 and len(client.params) == 1


def test_logit_bias_past_pythons_number_limits_is_a_400_or_clamped_not_a_500():
    """A logit_bias key of 5000 digits (int() refuses past 4300) and a value written as an integer past a float's
    range (math.isnan overflowed on it) each raised out of the route: a 500. The key is refused as no token id; the
    value is clamped to 100, as any value past +-100 is."""
    client = ScriptedClient(["a"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128)
    long_key, huge_value = post_all(app, [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"9" * 5000: 1}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "logit_bias": {"7": 10 ** 400, "8": -(10 ** 400)}})])
    assert long_key.status_code == 400 and "logit_bias keys must be token ids" in long_key.json()["error"]["message"]
    assert huge_value.status_code == 200 and dict(client.params[-1].logit_bias) == {7: 100.0, 8: -100.0}


def test_an_anyof_or_required_tools_past_the_limit_is_a_400_before_any_grammar_compiles():
    """Each schema of an anyOf (or oneOf), and each tool under tool_choice "required", is a branch of one grammar,
    whose compile took xgrammar 32 s for 3000 (a 300 KB body) on the one thread that compiles every request's grammar.
    Past the limit either is refused when the request is read, the tools naming the tools; at it, taken."""
    from tpgraph.engine.structured import MAX_SCHEMA_BRANCHES

    def branch(i: int) -> dict:
        return {"type": "object", "properties": {"k": {"const": f"v{i}"}}, "required": ["k"]}

    def tool(i: int) -> dict:
        return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}

    client = ScriptedClient(['[{"name": "f0", "parameters": {}}]'])
    # (a context that holds the 500 tools' rendered prompt)
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 200_000)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    wide, many_tools, at_limit, tools_at_limit = post_all(app, [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": {
            "oneOf": [branch(i) for i in range(MAX_SCHEMA_BRANCHES + 1)]}}),
        ("/v1/chat/completions", {**chat, "tool_choice": "required",
                                  "tools": [tool(i) for i in range(MAX_SCHEMA_BRANCHES + 1)]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": {
            "anyOf": [branch(i) for i in range(MAX_SCHEMA_BRANCHES)]}}),
        ("/v1/chat/completions", {**chat, "max_tokens": 40, "tool_choice": "required",
                                  "tools": [tool(i) for i in range(MAX_SCHEMA_BRANCHES)]})])
    assert wide.status_code == many_tools.status_code == 400
    assert f"anyOf or oneOf of {MAX_SCHEMA_BRANCHES + 1} schemas" in wide.json()["error"]["message"]
    assert f"at most {MAX_SCHEMA_BRANCHES} tools" in many_tools.json()["error"]["message"]
    assert at_limit.status_code == tools_at_limit.status_code == 200, tools_at_limit.text
    assert len(client.params) == 2


def test_a_streamed_token_arms_no_timer_of_its_own(monkeypatch):
    """The wait for a request's next update wakes to check for a gone client every DISCONNECT_CHECK_S; it armed (and
    cancelled) a timer for every update, a timer handle and heap work per token, ~10% of the front end's time per
    token at 256 streams (bench/bench_server_tokens.py). A ticker per request does it."""
    armed: list = []
    call_at = asyncio.BaseEventLoop.call_at

    def counting(self, when, callback, *args, **kwargs):
        armed.append(callback)
        return call_at(self, when, callback, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_at", counting)
    app = server_app.create_app(ScriptedClient(["x"] * 200, finish="length"), builtin_codec(), ServerMetrics(), "m",
                                512)
    reply = post_all(app, [("/v1/completions", {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 200})])[0]
    assert [c["choices"][0]["text"] for c in sse_events(reply.text)] == ["x"] * 200
    assert len(armed) < 10, len(armed)
