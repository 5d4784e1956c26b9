"""vLLM's use_beam_search through the server: the built-in model on CPU behind the bridge and engine service that
tpgraph.serve runs (here in one process, the app driven over ASGI), whose replies hold the sequences, texts, finish
reasons and token counts of TPEngine.beam_search (another engine's, the same weights) in vLLM's shape; what a search
cannot honour is a 400 that says why, and the server serves on."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from tpgtest.served import Served  # noqa: E402
from tpgtest.server_stubs import sse_events  # noqa: E402

from tpgraph import BeamSearchParams, TPEngine  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402

ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=64, num_kv_blocks=160, block_size=4)
PROMPTS = ["The quick brown fox", "tpgraph"]
EOS = 257  # (the built-in tokenizer's)


@pytest.fixture(scope="module")
def reference():
    with TPEngine(**ENGINE) as e:
        yield e


@pytest.fixture(scope="module")
def served():
    s = Served(TPEngine(**ENGINE))
    yield s
    s.close()


def completion(served: Served, **fields):
    return served.post("/v1/completions", {"model": "m", "use_beam_search": True, "temperature": 0.0,
                                           "return_token_ids": True, **fields})


def reply_tokens(seq, prompt_len: int, include_stop: bool = False) -> list[int]:
    """A searched sequence's tokens as vLLM's server returns them: the EOS that ended it only with
    include_stop_str_in_output."""
    generated = seq.tokens[prompt_len:]
    return generated[:-1] if seq.finish_reason == "stop" and not include_stop else generated


def assert_reply_is_the_search(choices: list[dict], prompt_ids: list[int], output, tokenizer) -> None:
    """The reply's choices are the search's sequences, best first: tokens, text (the generated tokens' alone, the
    EOS's never), finish_reason and stop_reason."""
    assert len(choices) == len(output.sequences)
    for choice, seq in zip(choices, output.sequences, strict=True):
        ids = reply_tokens(seq, len(prompt_ids))
        assert choice["token_ids"] == ids
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        if seq.finish_reason == "length":  # (the offline text is the prompt's and the reply's, as vLLM's)
            assert seq.text == tokenizer.decode(prompt_ids) + text
        assert (choice["finish_reason"], choice["stop_reason"]) == (seq.finish_reason, seq.stop_reason)


@pytest.mark.parametrize("width, steps, penalty", [(1, 5, 1.0), (3, 6, 1.0), (4, 4, 0.5)])
def test_completions_find_tp_engines_beams(served, reference, width, steps, penalty):
    """n=k is beam_width=k: every prompt's k choices are TPEngine.beam_search's sequences, ranked best first and
    numbered 0.. across the prompts; usage counts each prompt once and every returned token, as vLLM's."""
    r = completion(served, prompt=PROMPTS, n=width, max_tokens=steps, length_penalty=penalty)
    assert r.status_code == 200, r.text
    body = r.json()
    outputs = reference.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps,
                                                              length_penalty=penalty))
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    tokenizer = reference.get_tokenizer()
    at = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = reference.encode(prompt)
        got = choices[at:at + len(out.sequences)]
        assert all(c["prompt_token_ids"] == ids for c in got)
        assert_reply_is_the_search(got, ids, out, tokenizer)
        at += len(out.sequences)
    assert at == len(choices)
    prompt_tokens = sum(len(reference.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")


def test_completion_logprobs_are_each_tokens_step_candidates(served, reference):
    """logprobs: each token's log-probability (their sum the sequence's cum_logprob) and the most likely of its
    step's 2 * n candidates, the token too (as a sampled reply's); an echo (without logprobs) comes before the
    text."""
    r = completion(served, prompt=PROMPTS[0], n=2, max_tokens=4, logprobs=3, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    (out,) = reference.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4))
    echoed = completion(served, prompt=PROMPTS[0], n=2, max_tokens=4, echo=True).json()["choices"]
    for choice, echo, seq in zip(r.json()["choices"], echoed, out.sequences, strict=True):
        assert echo["text"] == PROMPTS[0] + choice["text"] and echo["token_ids"] == choice["token_ids"]
        lps = choice["logprobs"]
        assert sum(lps["token_logprobs"]) == pytest.approx(seq.cum_logprob, abs=1e-4)
        assert lps["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for top, token, token_lp in zip(lps["top_logprobs"], lps["tokens"], lps["token_logprobs"], strict=True):
            assert 3 <= len(top) <= 4 and top[token] == token_lp and max(top.values()) >= token_lp


def test_chat_finds_tp_engines_beams_whole_or_streamed(served, reference):
    """A chat's n beams are TPEngine.beam_search's on the rendered prompt; streamed (vLLM's chat streams a search's
    reply), each choice's content and finish are the whole reply's, and the last chunk's usage its usage."""
    request = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "use_beam_search": True, "n": 3,
               "max_tokens": 5, "temperature": 0.0, "return_token_ids": True}
    r = served.post("/v1/chat/completions", request)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    (out,) = reference.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=5))
    choices = [{**c, "text": c["message"]["content"]} for c in body["choices"]]
    assert_reply_is_the_search(choices, ids, out, reference.get_tokenizer())
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["message"]["role"] == "assistant" for c in choices)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)

    streamed = served.post("/v1/chat/completions", {**request, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    events = sse_events(streamed.text)
    text, finish = ["", "", ""], [None, None, None]
    for e in events:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    assert text == [c["text"] for c in choices] and finish == [c["finish_reason"] for c in choices]
    assert events[-1]["usage"] == body["usage"]


def test_a_streamed_completions_search_is_its_whole_reply_as_one_event(served):
    """stream: true with use_beam_search is taken, as vLLM's server takes it: the search's beams are ranked only once
    it ends, so the stream is one event, the whole reply (usage included), then [DONE]."""
    fields = dict(prompt=PROMPTS, n=2, max_tokens=4, echo=True)
    whole = completion(served, **fields)
    assert whole.status_code == 200, whole.text
    r = completion(served, **fields, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    (event,) = sse_events(r.text)
    want = whole.json()
    assert {k: v for k, v in event.items() if k not in ("id", "created")} == \
        {k: v for k, v in want.items() if k not in ("id", "created")}
    assert event["object"] == "text_completion" and event["id"].startswith("cmpl-")


@pytest.mark.parametrize("path, fields, status, needle", [
    ("/v1/completions", {"top_p": 0.5}, 400, "top_p is not used by a beam search"),
    ("/v1/completions", {"stop": ["a"]}, 400, "stop is not used by a beam search"),
    ("/v1/completions", {"n": 11}, 400, "n 11 needs 22 log-probabilities a step with use_beam_search (2 * n), "
                                        "more than this server's max_logprobs 20: at most n 10"),
    ("/v1/completions", {"n": 2, "logprobs": 5}, 400, "logprobs 5 is more than use_beam_search returns"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, 400, "echo with logprobs is not supported"),
    ("/v1/completions", {"max_tokens": 0}, 400, "max_tokens must be >= 1, got 0"),
    ("/v1/completions", {"max_tokens": 100}, 400, "ask for at most"),
    ("/v1/completions", {"guided_regex": "[0-9]+"}, 400, "structured outputs"),
    ("/v1/completions", {"priority": 3}, 400, "needs a server started with --scheduling-policy priority"),
    ("/v1/chat/completions", {"top_logprobs": 5, "logprobs": True, "n": 2}, 400,
     "top_logprobs 5 is more than use_beam_search returns"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, 400, "structured outputs"),
    ("/v1/chat/completions", {"presence_penalty": 1.0}, 400, "presence_penalty is not used by a beam search"),
])
def test_what_a_search_cannot_honour_is_a_400_and_the_server_serves_on(served, path, fields, status, needle):
    base = {"model": "m", "use_beam_search": True, "max_tokens": 3}
    base.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = served.post(path, {**base, **fields})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.text
    assert completion(served, prompt="a", n=2, max_tokens=2).status_code == 200
    assert served.post("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def eos_served(reference):
    """Both engines made to end where the model is likely to go on after "tpgraph" (test_beam_search's
    make_eos_likely): EOS's embedding row twice that token's."""
    import torch

    ids = reference.encode("tpgraph")
    likely = int(reference.generate([ids], _greedy(1))[0].outputs[0].token_ids[0])
    engines = [TPEngine(**ENGINE), TPEngine(**ENGINE)]
    for e in engines:
        with torch.no_grad():
            e.model.embed_tokens.weight[EOS] = 2 * e.model.embed_tokens.weight[likely]
    s = Served(engines[0])
    yield s, engines[1]
    s.close()
    engines[1].close()


def _greedy(n: int):
    from tpgraph import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.mark.parametrize("include_stop", [False, True])
def test_beams_the_eos_ended_come_back_as_vllms(eos_served, include_stop):
    """A sequence the EOS ended finishes "stop" with stop_reason the EOS id, its text without the EOS's, its tokens
    (and so usage) the EOS only with include_stop_str_in_output, as vLLM's server returns it."""
    served, local = eos_served
    r = completion(served, prompt="tpgraph", n=3, max_tokens=5, length_penalty=0.0,
                   include_stop_str_in_output=include_stop)
    assert r.status_code == 200, r.text
    (out,) = local.beam_search(["tpgraph"], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.0))
    ids = local.encode("tpgraph")
    choices = r.json()["choices"]
    assert any(s.finish_reason == "stop" for s in out.sequences)
    tokenizer = local.get_tokenizer()
    for choice, seq in zip(choices, out.sequences, strict=True):
        assert choice["token_ids"] == reply_tokens(seq, len(ids), include_stop)
        assert choice["text"] == tokenizer.decode(reply_tokens(seq, len(ids)), skip_special_tokens=True)
        assert (choice["finish_reason"], choice["stop_reason"]) == (seq.finish_reason, seq.stop_reason)
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


@pytest.mark.parametrize("penalty", [400.0, -400.0])
def test_an_extreme_length_penalty_is_searched_not_a_500(eos_served, penalty):
    """A length_penalty whose power of a length leaves the float range (the prompt's 8 tokens counted: 8.0 ** 400
    overflows, 8.0 ** -400 is 0.0) is a 200 on both endpoints, its choices TPEngine.beam_search's, ranked as the
    exact score ranks them (400: the longest first; -400: the shortest), and the server serves on."""
    served, local = eos_served
    r = completion(served, prompt="tpgraph", n=3, max_tokens=5, length_penalty=penalty)
    assert r.status_code == 200, r.text
    (out,) = local.beam_search(["tpgraph"], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=penalty))
    ids = local.encode("tpgraph")
    assert_reply_is_the_search(r.json()["choices"], ids, out, local.get_tokenizer())
    lengths = [len(s.tokens) - (s.finish_reason == "stop") for s in out.sequences]
    assert lengths == sorted(lengths, reverse=penalty > 0)
    chat = served.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "tpgraph"}],
                                                 "use_beam_search": True, "n": 3, "max_tokens": 5,
                                                 "temperature": 0.0, "length_penalty": penalty})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 3
    assert completion(served, prompt="a", n=2, max_tokens=2).status_code == 200


def test_a_client_that_leaves_mid_search_ends_it_and_its_requests(served, monkeypatch):
    """A step's requests see the client gone (Api.run aborts them): the search stops there, yielding nothing, and no
    request of it is left in the engine."""
    import time
    from types import SimpleNamespace

    from tpgraph.server import app as server_app

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    monkeypatch.setattr(server_app, "DISCONNECT_CHECK_S", 0.0)  # (checked at once: gone before a step ends)
    api = server_app.Api(served.client, ServerMetrics(), "m")
    prompt = served.engine.encode(PROMPTS[0])
    beam = BeamSearchParams(beam_width=2, max_tokens=8)
    params = server_app._beam_reply_params(beam, SimpleNamespace(seed=None, priority=0, cache_salt=None), None, True)

    async def search() -> list:
        return [u async for u in api.beam_search(Gone(), [prompt], beam, params, EOS, str)]

    assert served.call(search()) == []
    deadline = time.monotonic() + 10
    while served.engine.core.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not served.engine.core.requests
    monkeypatch.undo()  # (a check every 0 s never waits for an update long enough to take it)
    assert completion(served, prompt="a", n=2, max_tokens=2).status_code == 200


def test_each_steps_request_carries_the_searchs_seed_priority_and_cache_salt(served, monkeypatch):
    """A search's steps are requests of their own: each carries the request's seed and cache_salt (its blocks shared
    only under that salt), as a sampled request's params do."""
    sent = []
    submit = served.client.submit

    def recording(request_id, prompt_ids, params, sink):
        sent.append(params)
        return submit(request_id, prompt_ids, params, sink)

    monkeypatch.setattr(served.client, "submit", recording)
    assert completion(served, prompt=PROMPTS[0], n=2, max_tokens=3, seed=5, cache_salt="tenant").status_code == 200
    assert sent and {(p.seed, p.cache_salt) for p in sent} == {(5, "tenant")}
