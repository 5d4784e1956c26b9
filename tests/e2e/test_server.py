"""`torchrun --nproc-per-node 2 -m tpgraph.serve` on the built-in model (gloo, CPU), driven with the official openai
client: completions, chat, streaming, stops, concurrency against TPEngine.generate, bad input, SIGTERM."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from tpgtest.logprobs import own_logprobs, top_ids

openai = pytest.importorskip("openai")
# One pytest worker takes the whole file (--dist loadgroup): its module-scoped server starts once, not once a worker.
pytestmark = pytest.mark.xdist_group("one_server")

MODEL = "tpgraph-builtin"
ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "16", "--block-size", "8"]
PROMPTS = [f"Prompt {i}: " + "ab" * i for i in range(16)]


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 60) -> Reply:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int, ranks: int = 2, torchrun: bool = True, env: dict | None = None,
                 wait: bool = True, flags: tuple[str, ...] = ()) -> None:
        """torchrun False: `python -m tpgraph.serve -tp N`, which starts its other ranks itself. wait False: return
        as soon as it is started, not once /health answers. flags: server flags after ENGINE_FLAGS."""
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # a file, not a pipe: it never fills up
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "tpgraph.serve"] if torchrun \
            else ["-m", "tpgraph.serve", "-tp", str(ranks)]
        self.proc = subprocess.Popen(
            [sys.executable, *launch, "--port", str(port), *ENGINE_FLAGS, *flags], stdout=self.log,
            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        if not wait:
            return
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.output()}")
            try:
                if http("GET", f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("the server did not come up in 180 s")

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def post(self, path: str, body: dict | str) -> Reply:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        return http("POST", f"{self.url}{path}", data)

    def output(self) -> str:
        self.log.flush()
        return open(self.log.name).read()

    def wait_for(self, text: str, seconds: float = 180) -> str:
        """The output up to the moment `text` is in it (checked every 5 ms)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            out = self.output()
            if text in out:
                return out
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited before saying {text!r}:\n{out[-3000:]}")
            time.sleep(0.005)
        raise TimeoutError(f"the server did not say {text!r} in {seconds} s:\n{self.output()[-3000:]}")

    def ranks(self) -> list[int]:
        """The worker processes (torchrun starts each in its own session)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> str:
        for pid in [*self.ranks(), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        return self.output()


@pytest.fixture(scope="module")
def server():
    s = Server(free_port(), flags=("--enable-prompt-tokens-details",))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local_engine():
    """TPEngine in this process, set up as the server's engine (ENGINE_FLAGS), to hold the server's replies to."""
    from tpgraph import TPEngine

    with TPEngine(device="cpu", max_model_len=128, max_num_seqs=16, block_size=8) as engine:
        yield engine


def greedy(**kw):
    return {"temperature": 0.0, **kw}


def ids_of(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def served_greedy(server: Server, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The greedy token ids the server streams for each prompt, every prompt at once (a thread each)."""
    c = server.client()

    def one(prompt):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, logprobs=0,
                                 extra_body={"return_tokens_as_token_ids": True}, **greedy())
        return ids_of(r.choices[0])

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_the_server_warms_up_before_serving(server):
    assert "warmed up in" in server.output()


def test_models_health_version_and_the_tokenizer_routes(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert http("GET", f"{server.url}/health").status_code == 200
    assert http("GET", f"{server.url}/version").json()["version"]
    ids = server.post("/tokenize", {"prompt": "Hi"}).json()["tokens"]  # (BOS, then the built-in model's bytes)
    assert ids[1:] == [72, 105] and server.post("/detokenize", {"tokens": ids[1:]}).json() == {"prompt": "Hi"}
    info = http("GET", f"{server.url}/tokenizer_info").json()  # (the engine's EOS reaches the front end)
    assert (info["bos_token"], info["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


def test_completion_stream_equals_non_stream(server):
    c = server.client()
    whole = c.completions.create(model=MODEL, prompt="a" * 20, max_tokens=10, **greedy())
    text = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model=MODEL, prompt="a" * 20, max_tokens=10, stream=True, **greedy()) if chunk.choices)
    assert whole.choices[0].text == text and text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10


def test_chat_stream_equals_non_stream(server):
    c = server.client()
    messages = [{"role": "user", "content": "a" * 20}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **greedy())
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8


def test_a_response_is_the_chats_reply_whole_streamed_and_continued(server):
    """The Responses API on the TP=2 server: the greedy reply to an input is the chat reply to the same message,
    streamed as whole; a response continued by its id runs the chat of the whole conversation."""
    c = server.client()
    messages = [{"role": "user", "content": "a" * 20}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **greedy())
    whole = c.responses.create(model=MODEL, input="a" * 20, max_output_tokens=8, **greedy())
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == "incomplete" and whole.usage.output_tokens == 8
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    with c.responses.stream(model=MODEL, input="a" * 20, max_output_tokens=8, **greedy()) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    more = c.responses.create(model=MODEL, input="b" * 5, previous_response_id=whole.id, max_output_tokens=4,
                              **greedy())
    chat = c.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        *messages, {"role": "assistant", "content": whole.output_text}, {"role": "user", "content": "b" * 5}],
        **greedy())
    assert more.output_text == chat.choices[0].message.content and more.previous_response_id == whole.id
    assert c.responses.retrieve(more.id).output_text == more.output_text


def test_a_message_is_the_chats_reply_whole_and_streamed(server):
    """Anthropic's Messages API on the TP=2 server, through the anthropic SDK: the greedy reply is the chat reply to
    the same conversation, streamed as whole, and count_tokens is its prompt's length."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "a" * 20}]
    chat = server.client().chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "b" * 5},
                                                                          *messages], max_tokens=8, **greedy())
    whole = c.messages.create(model=MODEL, system="b" * 5, messages=messages, max_tokens=8,
                             extra_body={"temperature": 0.0})
    assert whole.content[0].text == chat.choices[0].message.content and whole.stop_reason == "max_tokens"
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    with c.messages.stream(model=MODEL, system="b" * 5, messages=messages, max_tokens=8,
                           extra_body={"temperature": 0.0}) as stream:
        text = "".join(stream.text_stream)
    assert text == whole.content[0].text
    assert c.messages.count_tokens(model=MODEL, system="b" * 5, messages=messages).input_tokens == \
        chat.usage.prompt_tokens


def test_stop_strings_and_max_tokens(server):
    c = server.client()
    full = c.completions.create(model=MODEL, prompt="a" * 20, max_tokens=12, **greedy()).choices[0].text
    assert full[:4] == "aaaa"
    stopped = c.completions.create(model=MODEL, prompt="a" * 20, max_tokens=12, stop=["aa"], **greedy()).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("", "stop")
    short = c.completions.create(model=MODEL, prompt="a" * 20, max_tokens=3, **greedy())
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_n_choices_each_finish_streamed_or_not(server):
    """n = 2: two choices, each with its finish reason, on both endpoints (a request with n > 1 used to hang)."""
    c = server.client().with_options(max_retries=0, timeout=60)
    kw = dict(model=MODEL, n=2, max_tokens=3, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    whole = c.completions.create(prompt="Hi", **kw)
    assert [(ch.index, ch.finish_reason) for ch in whole.choices] == [(0, "length"), (1, "length")]
    assert whole.usage.completion_tokens == 6
    chunks = [ch.choices[0] for ch in c.completions.create(prompt="Hi", stream=True, **kw) if ch.choices]
    assert {ch.index: ch.finish_reason for ch in chunks if ch.finish_reason} == {0: "length", 1: "length"}
    chat = c.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
    assert [(ch.index, ch.finish_reason) for ch in chat.choices] == [(0, "length"), (1, "length")]


def test_streamed_text_offsets_run_on_as_the_whole_replys(server):
    body = {"model": MODEL, "prompt": "a" * 20, "max_tokens": 6, "logprobs": 1, "temperature": 0,
            "ignore_eos": True}
    whole = server.post("/v1/completions", body).json()["choices"][0]["logprobs"]["text_offset"]
    r = http("POST", f"{server.url}/v1/completions", json.dumps({**body, "stream": True}).encode())
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == whole and len(whole) == 6 and whole[-1] > 0


def test_completion_top_logprobs_hold_the_sampled_token(server):
    """The OpenAI completions API: `logprobs` top tokens and always the sampled one (up to logprobs + 1)."""
    for logprobs in (0, 2):
        body = {"model": MODEL, "prompt": "a" * 20, "max_tokens": 4, "logprobs": logprobs, "temperature": 1.0,
                "seed": 3, "return_tokens_as_token_ids": True, "ignore_eos": True}
        lp = server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert top[token] == value and logprobs <= len(top) <= logprobs + 1


def test_chat_logprob_bytes_are_the_tokens_bytes(server):
    """The built-in model's tokens are bytes: each entry's `bytes` is its one byte, where its text may be U+FFFD."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 1.0,
            "seed": 2, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    content = server.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    entries = content + [top for c in content for top in c["top_logprobs"]]
    assert len(content) == 12 and all(e["bytes"] == [int(e["token"].removeprefix("token_id:"))] for e in entries
                                      if int(e["token"].removeprefix("token_id:")) < 256)


def test_logit_bias_steers_every_rank_on_both_endpoints(server):
    """Bias 100 on the byte "A" makes greedy decoding all but forced to it, streamed or not, while -100 on what an
    unbiased greedy request produces first moves it off that token (TP=2: every rank samples with the bias)."""
    c = server.client()
    forced = c.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logit_bias={"65": 100}, **greedy())
    assert forced.choices[0].text == "AAAAA"
    chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       stream=True, logit_bias={"65": 100}, **greedy())
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "AAAA"
    kw = dict(model=MODEL, prompt="Hi", max_tokens=1, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    first = ids_of(c.completions.create(**kw, **greedy()).choices[0])[0]
    banned = c.completions.create(**kw, logit_bias={str(first): -100}, **greedy()).choices[0]
    assert ids_of(banned)[0] != first


def test_an_api_key_from_the_environment_is_asked_of_clients():
    """TPGRAPH_API_KEY reaches the spawned front end: OpenAI's client with the key is served, a request without it
    gets a 401, and /health stays open to probes."""
    keyed = Server(free_port(), ranks=1, torchrun=False, env={"TPGRAPH_API_KEY": "k3y"})
    try:
        refused = http("GET", f"{keyed.url}/v1/models")
        assert refused.status_code == 401 and "needs an API key" in refused.json()["error"]["message"]
        c = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="k3y", max_retries=0, timeout=60)
        assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        assert http("GET", f"{keyed.url}/health").status_code == 200
    finally:
        keyed.stop()


def test_tool_calls_named_required_and_auto():
    """Function calling through the OpenAI client on a server with a tool-call parser (hermes): a named function and
    "required" are held to the tools' schemas by the grammar, so even the built-in model's random weights make valid
    calls; "auto" reads the calls the model writes (here made to write one by a regex)."""
    pytest.importorskip("xgrammar")
    # (1024: the last turn's history, its tools written out as vLLM dumps them, is ~560 byte-level tokens)
    served = Server(free_port(), ranks=1, torchrun=False,
                    flags=("--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "get_time"}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    try:
        c = served.client()
        named = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=60, seed=1,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        # (content "" beside a forced call, as vLLM's named and required tool choices give it)
        assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content == ""
        required = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=100, seed=2,
                                             tool_choice="required", parallel_tool_calls=False, stream=True)
        streamed = {}
        finish = None
        for chunk in required:
            for d in chunk.choices[0].delta.tool_calls or []:
                streamed.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        ((name, args),) = streamed.values()
        assert name in ("get_weather", "get_time") and isinstance(json.loads(args), dict) and finish == "tool_calls"
        forced = '<tool_call>\\{"name": "get_time", "arguments": \\{\\}\\}</tool_call>'
        auto = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=120, seed=3,
                                         extra_body={"guided_regex": forced})
        assert [(t.function.name, t.function.arguments) for t in auto.choices[0].message.tool_calls] == [
            ("get_time", "{}")]
        assert auto.choices[0].finish_reason == "tool_calls"
        # streamed, a call is sent once its arguments begin, and they come as they are generated
        forced = '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Oslo"\\}\\}</tool_call>'
        chunks = list(c.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=120, seed=3,
                                                stream=True, extra_body={"guided_regex": forced}))
        pieces = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in pieces if d.id] == ["get_weather"] and len(pieces) > 3
        assert "".join(d.function.arguments or "" for d in pieces) == '{"city": "Oslo"}'
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the history of a call goes back to the model, and a plain reply comes back as text
        history = [*messages, {"role": "assistant", "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "-3 C"}]
        plain = c.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=4, seed=4,
                                          tool_choice="none")
        assert plain.choices[0].message.tool_calls is None and plain.usage.completion_tokens == 4
    finally:
        served.stop()


def test_a_reasoning_server_splits_the_thoughts_and_holds_only_the_answer_to_a_grammar(tmp_path):
    """--reasoning-parser deepseek_r1 on a checkpoint whose tokenizer has </think> as an added token (as R1's
    distillations do): the reply's thoughts go to message.reasoning, and a JSON schema holds only the answer after
    </think> (the bias makes the model close its thoughts at once; the grammar then masks that token). The built-in
    model's tokenizer splits </think>, and such a server refuses to start, saying why."""
    pytest.importorskip("xgrammar")
    from tpgtest.chat_fixtures import END_THINK_ID, make_chat_checkpoint

    ckpt = make_chat_checkpoint(tmp_path / "r1", think_tokens=True)
    served = Server(free_port(), ranks=1, torchrun=False, flags=(
        "--model", str(ckpt), "--load-format", "dummy", "--served-model-name", MODEL, "--reasoning-parser",
        "deepseek_r1"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    request = {"model": MODEL, "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 40, "temperature": 0,
               "logit_bias": {str(END_THINK_ID): 100},
               "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    try:
        whole = served.post("/v1/chat/completions", request).json()["choices"][0]
        assert whole["message"]["reasoning"] is None and isinstance(json.loads(whole["message"]["content"])["ok"], bool)
        assert whole["finish_reason"] == "stop"
        chunks = [json.loads(line[6:]) for line in served.post("/v1/chat/completions", {**request, "stream": True})
                  .text.splitlines() if line.startswith("data: {")]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert streamed == whole["message"]["content"]
        free = served.post("/v1/chat/completions", {**request, "response_format": None, "max_tokens": 3}).json()
        assert free["choices"][0]["message"]["content"] == "</think></think>"  # (the first one ended the thoughts)
    finally:
        served.stop()
    with pytest.raises(RuntimeError, match="has </think> as one token; this one splits it into"):
        Server(free_port(), ranks=1, torchrun=False, flags=("--reasoning-parser", "deepseek_r1"))


def test_echo_scores_a_prompt_as_lm_eval_asks(server, local_engine):
    """lm-eval's local-completions loglikelihood: token ids, echo, logprobs 1, max_tokens 1 (or 0, nothing generated):
    the prompt's text and its tokens' log-probabilities, the first null, equal to TPEngine's prompt_logprobs (TP=2
    against TP=1), then the generated token's."""
    ids = [72, 101, 108, 108, 111, 44, 32, 116, 112]  # "Hello, tp"
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "return_tokens_as_token_ids": True}
    one = server.post("/v1/completions", body).json()["choices"][0]
    zero = server.post("/v1/completions", {**body, "max_tokens": 0}).json()
    from tpgraph import SamplingParams

    local = local_engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    lp = one["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in [*ids, *local.outputs[0].token_ids]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(own_logprobs(local.prompt_logprobs, ids)[1:], abs=1e-4)
    # each entry: the most likely token and always the prompt's own (one entry when they are the same)
    for top, alts, token in zip(lp["top_logprobs"][1:len(ids)], top_ids(local.prompt_logprobs, 1)[1:], ids[1:],
                                strict=True):
        assert set(top) == {f"token_id:{alts[0]}", f"token_id:{token}"}
    assert one["text"] == "Hello, tp" + local.outputs[0].text
    echoed = zero["choices"][0]
    assert (echoed["text"], echoed["finish_reason"], zero["usage"]["completion_tokens"]) == ("Hello, tp", "length", 0)
    assert echoed["logprobs"]["tokens"] == lp["tokens"][:len(ids)]
    assert echoed["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:len(ids)], abs=1e-5)


def test_a_streamed_echo_equals_the_whole_reply(server):
    """The prompt comes first, with the first token's chunk; joined, the chunks' text and log-probability tokens are
    the non-streamed reply's (a text prompt: echoed as given, without the BOS the tokenizer adds)."""
    body = {"model": MODEL, "prompt": "Hi there", "echo": True, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    for logprobs in (None, 2):
        whole = server.post("/v1/completions", {**body, "logprobs": logprobs}).json()["choices"][0]
        r = http("POST", f"{server.url}/v1/completions",
                 json.dumps({**body, "logprobs": logprobs, "stream": True}).encode())
        chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["text"] for c in chunks) == whole["text"] and whole["text"].startswith("Hi there")
        assert chunks[0]["text"].startswith("Hi there") and len(whole["text"]) > len("Hi there")
        if logprobs:
            assert [t for c in chunks for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
            assert len(whole["logprobs"]["tokens"]) == 1 + len("Hi there") + 4  # BOS, the bytes, the four
        else:
            assert whole["logprobs"] is None


def test_structured_outputs_through_both_endpoints(server):
    """OpenAI's response_format (a JSON schema, through the openai client) on chat, and vLLM's guided_choice and
    guided_regex on completions, streamed and not: each reply matches (TP=2: both ranks hold the grammar)."""
    pytest.importorskip("xgrammar")
    c = server.client()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say ok"}], max_tokens=20, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert isinstance(json.loads(chat.choices[0].message.content)["ok"], bool)
    assert chat.choices[0].finish_reason == "stop"
    choice = c.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="Code:", max_tokens=10, stream=True, temperature=0.0,
        extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"}) if ch.choices)
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", streamed), streamed


def test_sixteen_concurrent_requests_equal_tp_engine(server, local_engine):
    served = served_greedy(server, PROMPTS, 12)
    from tpgraph import SamplingParams

    local = local_engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    assert served == [o.outputs[0].token_ids for o in local]


def test_beam_search_at_tp2_finds_tp_engines_beams(server, local_engine):
    """use_beam_search on a TP=2 server: each step's beams are ordinary one-token requests, which rank 0 sends its
    follower as any other, so both endpoints return TPEngine.beam_search's sequences (best first, as vLLM's: the
    generated tokens, the EOS only with include_stop_str_in_output); a stream of completions is the whole reply as one
    event, as vLLM's server sends it, and the server serves on."""
    from tpgraph import BeamSearchParams, SamplingParams

    def generated(seq, prompt_len):
        return seq.tokens[prompt_len:-1] if seq.finish_reason == "stop" else seq.tokens[prompt_len:]

    search = {"model": MODEL, "use_beam_search": True, "n": 3, "max_tokens": 6, "temperature": 0.0,
              "return_token_ids": True}
    r = server.post("/v1/completions", {**search, "prompt": PROMPTS[:2]})
    assert r.status_code == 200, r.text
    outputs = local_engine.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=6))
    want = [generated(s, len(local_engine.encode(p))) for p, o in zip(PROMPTS[:2], outputs, strict=True)
            for s in o.sequences]
    assert [c["token_ids"] for c in r.json()["choices"]] == want
    assert r.json()["usage"]["completion_tokens"] == sum(len(ids) for ids in want)

    chat = server.post("/v1/chat/completions", {**search, "messages": [{"role": "user", "content": "a" * 10}]})
    assert chat.status_code == 200, chat.text
    ids = chat.json()["prompt_token_ids"]
    (out,) = local_engine.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=6))
    assert [c["token_ids"] for c in chat.json()["choices"]] == [generated(s, len(ids)) for s in out.sequences]

    streamed = server.post("/v1/completions", {**search, "prompt": PROMPTS[:2], "stream": True})
    assert streamed.status_code == 200, streamed.text
    (event,) = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                if line.startswith("data: {")]
    assert [c["token_ids"] for c in event["choices"]] == want and streamed.text.endswith("data: [DONE]\n\n")
    greedy_ids = local_engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert served_greedy(server, PROMPTS[:1], 4) == [greedy_ids.token_ids]


def test_four_ranks_serve_the_tokens_two_ranks_serve(server):
    """`torchrun --nproc-per-node 4 -m tpgraph.serve` (gloo, CPU): TP=4 streams the same greedy tokens as TP=2."""
    four = Server(free_port(), ranks=4)
    try:
        assert len(four.ranks()) == 4
        assert served_greedy(four, PROMPTS[:4], 8) == served_greedy(server, PROMPTS[:4], 8)
    finally:
        four.stop()


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", "{not json", 400, "not valid JSON"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt: Field required"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens must be >= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature must be in"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p must be in"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k must be >= 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 200}, 400, "max_model_len is 128"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 500}, 400, "ask for at most"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 500}, 400, "new tokens, or for none (null)"),
    ("/v1/completions", {"model": MODEL, "prompt": "", "add_special_tokens": False}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs must be between 0 and 20"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "", "content": "x"}]}, 400,
     "messages[0].role is empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 30}, 400, "logprobs must be between 0 and 20"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0, "max_tokens": 5}, 400, "max_completion_tokens must be >= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options is only allowed with stream: true"),
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt is not valid Unicode text"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}, 400,
     "lone surrogate"),
    # refused by its length alone, before it is tokenized (the built-in tokenizer: at most 17 characters a token)
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, 400, "5000 characters, more than 128 tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [True, False]}, 400, "token ids must be integers"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, -3], "echo": True}, 400, "prompt token ids must be integers in"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 2 ** 40]}, 400, "prompt token ids must be integers in"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": 2 ** 40}, 400, "min_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     '"auto" tool choice (the default when tools are given) needs a server started with --enable-auto-tool-choice'),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice names 'g', which is not among the tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "needs json_schema.schema"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "[0-9"}, 400, "the regex cannot be used"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}, 400,
     "give one of response_format"),
    ("/v1/nothing", {"model": MODEL}, 404, "Not Found"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400,
     "logit_bias token ids must be below the vocabulary size"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"a": 1}}, 400, "logit_bias keys must be token ids"),
])
def test_bad_input_gets_a_reason_and_the_server_keeps_serving(server, path, body, status, needle):
    r = server.post(path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.text
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_null_means_the_default_as_openai_clients_send_it(server):
    """LangChain and others send explicit nulls; they mean the default (a completion's max_tokens null: 16, as
    vLLM's)."""
    nulls = dict.fromkeys(["n", "stream", "echo", "min_tokens", "ignore_eos", "skip_special_tokens", "seed",
                           "include_stop_str_in_output", "stream_options", "logprobs", "stop"])
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 3, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a", "name": None}], "max_tokens": 3,
            **nulls, "logprobs": None, "add_generation_prompt": None, "top_logprobs": None}
    del chat["echo"]
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "a", "n": None, "max_tokens": None,
                                           "ignore_eos": True}).json()["usage"]["completion_tokens"] == 16


def test_text_holds_every_token_even_bytes_that_never_make_a_character(server):
    """The built-in model's tokens are bytes, and its random weights often end on bytes that are not UTF-8: the text
    must still be the decode of every generated id (U+FFFD for those bytes), streamed or not."""
    from tpgraph.tokenizer import builtin_tokenizer

    tok = builtin_tokenizer()
    for seed in range(6):
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 1.0, "seed": seed,
                "logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}
        choice = server.post("/v1/completions", body).json()["choices"][0]
        ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        assert choice["text"] == tok.decode(ids), (seed, ids)
        r = http("POST", f"{server.url}/v1/completions", json.dumps({**body, "stream": True}).encode())
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_stream_chunks_carry_null_usage_until_the_last(server):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    r = http("POST", f"{server.url}/v1/completions", json.dumps(body).encode())
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 3


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(server):
    """--enable-prompt-tokens-details: a prompt sent again finds its whole blocks cached (block size 8)."""
    body = {"model": MODEL, "prompt": "Cached tokens are counted: " * 3, "max_tokens": 2, "temperature": 0}
    first, again = (http("POST", server.url + "/v1/completions", json.dumps(body).encode()).json() for _ in range(2))
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # (no other test sends this prompt)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 8 * 8}


def test_a_huge_prompt_does_not_hold_up_other_requests(server):
    """A 1.8 MB prompt is refused by its length alone (it took 11 s of tokenizing, during which nothing else was
    answered); tests/unit/test_prompts.py checks that tokenizing leaves other threads running."""
    big = json.dumps({"model": MODEL, "prompt": "ab " * 600_000, "max_tokens": 1}).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(http, "POST", f"{server.url}/v1/completions", big)
        time.sleep(0.3)
        start = time.monotonic()
        assert http("GET", f"{server.url}/health").status_code == 200
        took = time.monotonic() - start
        assert slow.result().status_code == 400
    assert took < 1.0, took


def metric(server, name: str, **labels: str) -> float:
    """The first sample of `name` whose labels include `labels` (0 where none is served yet)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for line in http("GET", f"{server.url}/metrics").text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_disconnect_aborts_its_request(server):
    before = metric(server, "vllm:request_success_total", finished_reason="abort")
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 120, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: ")  # streaming has begun
    deadline = time.monotonic() + 20
    while metric(server, "vllm:request_success_total", finished_reason="abort") <= before:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.2)
    while metric(server, "vllm:num_requests_running") != 0:  # the engine drops it at its next turn
        assert time.monotonic() < deadline, "the aborted request is still running"
        time.sleep(0.2)


def test_metrics(server):
    text = http("GET", f"{server.url}/metrics").text
    # vLLM's names, labelled with the served name as vLLM's are (a dashboard built on vLLM's reads them), beside
    # what only this engine measures
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_hits_total",
                 "tpgraph_graph_steps_total", "tpgraph_control_path_seconds_count"):
        assert name in text, name
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}}' in text  # (the exposition sorts labels)
    before = metric(server, "vllm:prompt_tokens_total", model_name=MODEL)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "n": 2, "max_tokens": 2}).json()
    assert metric(server, "vllm:prompt_tokens_total", model_name=MODEL) - before == 6 == 2 * r["usage"]["prompt_tokens"]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_stops_every_rank_within_10_s():
    """Also with a stream in flight: the followers keep following until rank 0 says stop, so rank 0 is not left
    inside a step's collectives."""
    s = Server(free_port())
    try:
        ranks = s.ranks()
        assert len(ranks) == 2
        ranks += [p for r in ranks for p in children(r)]  # rank 0's HTTP front end (and its resource tracker)
        assert len(ranks) >= 3
        # (max_tokens null: up to max_model_len, the longest stream this server takes)
        body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": None, "stream": True, "ignore_eos": True,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{s.url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        stream = urllib.request.urlopen(req, timeout=60)
        assert stream.readline().startswith(b"data: ")  # generating
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
        while any(alive(p) for p in ranks) and time.monotonic() - start < 30:
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        assert elapsed < 10 and not any(alive(p) for p in ranks), (elapsed, s.output()[-2000:])
    finally:
        s.stop()


def test_ctrl_c_stops_every_torchrun_rank_cleanly():
    """Ctrl-C to torchrun, which passes SIGINT on to every rank (each in its own session). Before: the follower raised
    KeyboardInterrupt at once, in the middle of a message (or a step's collectives), and rank 0's engine loop then
    failed on the closed connection ("the engine loop failed", a traceback on each rank) instead of stopping every
    rank as SIGTERM does. (torchrun itself still reports the signal, with its own traceback and exit code.)"""
    s = Server(free_port())
    try:
        ranks = s.ranks()
        assert len(ranks) == 2
        assert s.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
        start = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGINT)  # (a terminal's Ctrl-C reaches torchrun's process group)
        s.proc.wait(timeout=60)
        while any(alive(p) for p in ranks) and time.monotonic() - start < 30:
            time.sleep(0.1)
        out = s.output()
        assert not any(alive(p) for p in ranks) and time.monotonic() - start < 10, out[-3000:]
        assert "KeyboardInterrupt" not in out and "the engine loop failed" not in out, out[-3000:]
        assert "tpgraph.engine.service" not in out and "Connection closed by peer" not in out, out[-3000:]
    finally:
        s.stop()


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_self_started_ranks_stop_cleanly(stop):
    """`python -m tpgraph.serve -tp 2`: SIGTERM to it, or Ctrl-C to its process group, ends it with code 0 and no
    error: its close used to tell the followers to stop a second time, over connections they had closed (a
    traceback), and Ctrl-C, which stops the front end first, was reported as the front end failing (code 1)."""
    s = Server(free_port(), torchrun=False)
    try:
        assert s.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
        if stop == "sigterm":
            s.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(s.proc.pid, signal.SIGINT)
        assert s.proc.wait(timeout=30) == 0, s.output()[-3000:]
        out = s.output()
        assert "Traceback" not in out and "ERROR" not in out, out[-3000:]
    finally:
        s.stop()


def test_an_address_in_use_is_refused_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "tpgraph.serve", "--port", str(port), *ENGINE_FLAGS],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"error: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr[-2000:]
    assert "warmed up" not in out.stderr and time.monotonic() - start < 60


# Every interpreter started with this on its PYTHONPATH (the server's ranks and its spawned front end) imports it, so
# the front end's uvicorn waits SLOW_LISTEN_S before it binds: a server that said "serving" before listening is caught.
SLOW_LISTEN = """
import os
if os.environ.get("TPGRAPH_TEST_SLOW_LISTEN_S"):
    import asyncio
    import uvicorn
    _startup = uvicorn.Server.startup

    async def startup(self, sockets=None):
        await asyncio.sleep(float(os.environ["TPGRAPH_TEST_SLOW_LISTEN_S"]))
        await _startup(self, sockets)

    uvicorn.Server.startup = startup
"""


@pytest.fixture
def slow_listen(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_LISTEN)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "TPGRAPH_TEST_SLOW_LISTEN_S": "2"}


def test_serving_is_said_once_the_port_accepts_connections(slow_listen):
    """A script that waits for the "serving" line and connects at once gets in: the line used to come before the
    front-end process had bound its port (connection refused, even without the slow listen)."""
    s = Server(free_port(), ranks=1, torchrun=False, env=slow_listen, wait=False)
    try:
        s.wait_for(f"serving {MODEL} on {s.url} (tp=1)")
        assert http("GET", f"{s.url}/health", timeout=5).status_code == 200
    finally:
        s.stop()


def test_a_front_end_that_cannot_listen_stops_every_rank_with_an_error(slow_listen):
    """rank 0 holds the port, bound, from before loading; a server that binds it anyway (with SO_REUSEADDR, as
    asyncio's do, which Linux lets bind beside a socket not listening yet) and listens first leaves the front end
    unable to listen: rank 0 says so, never says "serving", and every rank stops. Without SO_REUSEADDR it cannot."""
    s = Server(free_port(), torchrun=False, env=slow_listen, wait=False)  # (torchrun would stop rank 1 itself)
    with socket.socket() as thief:
        try:
            s.wait_for("warmed up in")  # the front end starts after the warm-up, then listens 2 s later
            processes = [*s.ranks(), *(p for r in s.ranks() for p in children(r))]
            with socket.socket() as polite, pytest.raises(OSError):  # (the port is held)
                polite.bind(("127.0.0.1", s.port))
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            thief.bind(("127.0.0.1", s.port))
            thief.listen()
            code = s.proc.wait(timeout=60)
            out = s.output()
            assert code == 1 and "the HTTP front end failed to start (exit code 3)" in out, out[-3000:]  # (uvicorn's 3)
            assert f"nothing serves {s.url}" in out and "address already in use" in out.lower(), out[-3000:]
            assert "serving" not in out and "Traceback" not in out, out[-3000:]
            assert wait_gone(processes, 30) < 30
        finally:
            s.stop()


def test_a_dead_front_end_stops_the_server_with_an_error():
    s = Server(free_port())
    try:
        rank0 = rank_pids(s)[0]
        front = [p for p in children(rank0) if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(front) == 1
        os.kill(front[0], signal.SIGKILL)
        code = s.proc.wait(timeout=30)
        assert code != 0, s.output()[-2000:]
        assert "the HTTP front end exited" in s.output()
    finally:
        s.stop()


# rank 0's step fails where a request asks for 7 tokens (rank 0's alone: it takes the variable out of the environment
# its started ranks and its front end inherit)
FAIL_STEP = """
import os
if os.environ.pop("TPGRAPH_TEST_FAIL_STEP", None):
    from tpgraph.engine import core

    _resolve = core.EngineCore._resolve

    def resolve(self):
        if self._in_flight is not None and any(seq.params.max_tokens == 7 for seq, _ in self._in_flight.rows):
            raise RuntimeError("rank 0's step failed")
        return _resolve(self)

    core.EngineCore._resolve = resolve
"""


def test_a_failed_step_stops_the_self_started_ranks_without_stepping_again(tmp_path):
    """`python -m tpgraph.serve -tp 2`, rank 0's step fails. Before: the server's loop failed, but closing the engine
    told the started ranks to stop through the engine's own loop (a second one, which had not failed), and that ran
    another step on the failed engine: a misleading traceback ("2 pending tokens but token source 0") from the
    close, which gave up before ending the started ranks."""
    (tmp_path / "sitecustomize.py").write_text(FAIL_STEP)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    s = Server(free_port(), torchrun=False, env={"PYTHONPATH": path, "TPGRAPH_TEST_FAIL_STEP": "1"})
    try:
        processes = [*s.ranks(), *(p for r in s.ranks() for p in children(r))]
        failed = s.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 7})
        assert failed.status_code == 500 and "rank 0's step failed" in failed.text, failed
        code = s.proc.wait(timeout=60)
        out = s.output()
        assert code == 1 and "stopping the other ranks" in out, out[-3000:]
        assert "Exception in thread" not in out and "pending tokens" not in out, out[-3000:]
        assert wait_gone(processes, 30) < 30
    finally:
        s.stop()


def rank_pids(server: Server) -> dict[int, int]:
    pids = {}
    for pid in server.ranks():
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next(int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK="))
        pids[rank] = pid
    return pids


def wait_gone(pids: list[int], seconds: float) -> float:
    start = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - start < seconds:
        time.sleep(0.2)
    return time.monotonic() - start


def test_a_killed_rank_takes_every_other_process_down_within_60_s():
    s = Server(free_port())
    try:
        pids = rank_pids(s)
        frontend = children(pids[0])
        assert frontend
        os.kill(pids[1], signal.SIGKILL)
        elapsed = wait_gone([pids[0], s.proc.pid, *frontend], 90)
        out = s.output()
        assert elapsed < 60, (elapsed, out[-3000:])
        assert "rank 1" in out or "local_rank: 1" in out, out[-3000:]
    finally:
        s.stop()


def test_a_frozen_rank_is_named_and_every_other_process_exits_within_60_s():
    s = Server(free_port())
    pids = rank_pids(s)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        elapsed = wait_gone([pids[0], s.proc.pid], 90)
        out = s.output()
        assert elapsed < 60, (elapsed, out[-3000:])
        assert "rank 1 stopped answering" in out, out[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGKILL)
        s.stop()


def test_prompt_logprobs_as_vllm_returns_them(server, local_engine):
    """vLLM's prompt_logprobs field on both endpoints: per prompt token (None first), the token's log-probability
    and rank and the top k, equal to TPEngine's; refused with stream."""
    from tpgraph import SamplingParams

    ids = local_engine.encode("The quick brown fox")
    want = local_engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    got = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                          "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for j in range(1, len(ids)):  # (the same Logprobs, as JSON: the token's own first, its text too)
        assert list(got[j]) == [str(t) for t in want.prompt_logprobs[j]] and len(got[j]) in (2, 3)
        for t, entry in want.prompt_logprobs[j].items():
            assert got[j][str(t)]["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
            assert (got[j][str(t)]["rank"], got[j][str(t)]["decoded_token"]) == (entry.rank, entry.decoded_token)
        assert got[j][str(ids[j])]["rank"] >= 1 and want.prompt_logprobs[j][ids[j]].decoded_token is not None
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # (k = 0: the token alone)
    streamed = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and "not available with stream" in streamed.json()["error"]["message"]


def front_ends(pid: int) -> list[int]:
    """The HTTP front-end processes rank 0 (`pid`) started (spawned interpreters; not its resource tracker)."""
    return [p for p in children(pid) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()
            and b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]


def test_several_api_server_processes_serve_one_address_and_stop_cleanly(local_engine, tmp_path):
    """--api-server-count 2: two front ends share the port; concurrent streams all get TPEngine's tokens, /metrics
    (either front end's) counts every request, a stored response is read back whichever front end a request lands
    on, and SIGTERM stops them all with exit code 0, their shared directory removed."""
    s = Server(free_port(), ranks=1, torchrun=False, env={"TMPDIR": str(tmp_path)},
               flags=("--api-server-count", "2"))
    try:
        # (said once both serve; /health may answer from the first before)
        s.wait_for(f"serving {MODEL} on {s.url} (tp=1, 2 API server processes)", 60)
        fronts = front_ends(s.proc.pid)
        assert len(fronts) == 2 and len(list(tmp_path.glob("tpgraph-*"))) == 1
        from tpgraph import SamplingParams

        served = served_greedy(s, PROMPTS, 12)
        local = local_engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
        assert served == [o.outputs[0].token_ids for o in local]
        for _ in range(4):  # (each scrape on a new connection: any front end may answer, each reports them all)
            counts = re.findall(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)$',
                                http("GET", f"{s.url}/metrics").text, re.M)
            assert [float(c) for c in counts] == [len(PROMPTS)]
        # the Responses API's store is front end 0's: a response stored through either is read back through either
        stored = s.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4}).json()
        for _ in range(6):
            got = http("GET", f"{s.url}/v1/responses/{stored['id']}")
            assert got.status_code == 200 and got.json()["output"] == stored["output"], got.text
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0, s.output()[-3000:]
        assert wait_gone(fronts, 10) < 10
        assert list(tmp_path.glob("tpgraph-*")) == []
    finally:
        s.stop()


def test_a_dead_front_end_of_several_stops_the_server_naming_it():
    s = Server(free_port(), ranks=1, torchrun=False, flags=("--api-server-count", "3"))
    try:
        # (/health may answer from one before the others serve: one killed then "failed to start", not "exited")
        s.wait_for(f"serving {MODEL} on {s.url} (tp=1, 3 API server processes)", 60)
        fronts = front_ends(s.proc.pid)
        assert len(fronts) == 3
        os.kill(fronts[1], signal.SIGKILL)
        assert s.proc.wait(timeout=30) == 1
        out = s.output()
        assert re.search(r"HTTP front end \d exited \(code -9\)", out), out[-3000:]
        assert wait_gone(fronts, 10) < 10
    finally:
        s.stop()


def test_a_second_server_on_the_port_of_several_front_ends_stops_rather_than_share_it():
    """Another server's SO_REUSEPORT sockets, bound on the port while this one loads (neither listening, so the
    start-up check passes) and listening before its front ends serve, would get half of its connections: the server
    stops, naming the address, and leaves the other's sockets alone."""
    from tpgraph.server.listeners import close_sockets, front_end_sockets

    port = free_port()
    theirs = front_end_sockets("127.0.0.1", port, None, 2)
    s = Server(port, ranks=1, torchrun=False, wait=False, flags=("--api-server-count", "2"))
    try:
        s.wait_for("warmed up", 60)  # (past its start-up check, before its front ends start)
        for each in theirs:
            each[0].listen()
        assert s.proc.wait(timeout=30) == 1
        out = s.output()
        assert f"another server listens on 127.0.0.1:{port} beside this one's front ends" in out, out[-3000:]
        assert "serving" not in out
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # (theirs, still listening)
            pass
    finally:
        s.stop()
        close_sockets([sock for each in theirs for sock in each])
