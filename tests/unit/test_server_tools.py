"""Function calling and reasoning through the chat endpoint (in process, an engine that answers with set text): tool
calls and thoughts in the reply, streamed and whole, each with OpenAI's shape, and the request's constraint sent to
the engine."""

import dataclasses
import json

import pytest

pytest.importorskip("fastapi")

from tpgtest.server_stubs import ScriptedClient, builtin_codec, post_all, sse_events  # noqa: E402

from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS  # noqa: E402
from tpgraph.server.tools import ToolOptions  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


PLAIN = ToolOptions()


def chat(pieces: list[str], body: dict, options: ToolOptions = PLAIN, finish: str = "stop",
         reasoning: str | None = None, tools: bool = True) -> tuple[dict, list[dict], ScriptedClient]:
    """The reply as a whole and as its streamed chunks' JSON, and the client that answered."""
    client = ScriptedClient(pieces, finish)
    parser = REASONING_PARSERS.get(reasoning.removesuffix("+special")) if reasoning else None
    if parser is not None and reasoning.endswith("+special"):  # (as for_tokenizer makes it for such a tokenizer)
        parser = dataclasses.replace(parser, keeps_special_tokens=True)
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128, tool_options=options,
                                reasoning=parser)
    request = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
               **({"tools": [WEATHER]} if tools else {}), **body}

    whole, streamed = post_all(app, [("/v1/chat/completions", request),
                                     ("/v1/chat/completions", {**request, "stream": True})])
    assert whole.status_code == 200, whole.text
    return whole.json(), sse_events(streamed.text), client


def folded(chunks: list[dict], index: int = 0) -> tuple[str, list[dict], str]:
    """A stream's chunks folded as a client does: content, tool calls (arguments joined), the last finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for d in delta.get("tool_calls", []):
                if d["index"] not in calls:  # (a call's first delta names it)
                    calls[d["index"]] = {"id": d["id"], "type": d["type"],
                                         "function": {"name": d["function"]["name"], "arguments": ""}}
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def without_ids(calls: list[dict]) -> list[dict]:
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def test_a_named_function_is_called_streamed_or_not():
    whole, chunks, client = chat(['{"city":', '"Oslo"}'], {"tool_choice": {"type": "function",
                                                                            "function": {"name": "get_weather"}}})
    message = whole["choices"][0]["message"]
    assert message["content"] == "" and whole["choices"][0]["finish_reason"] == "stop"
    expected = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    assert without_ids(message["tool_calls"]) == expected
    content, calls, finish = folded(chunks)
    assert content == "" and without_ids(calls) == expected and finish == "stop"
    assert [json.loads(p.structured.spec) for p in client.params] == [WEATHER["function"]["parameters"]] * 2


def test_required_calls_with_n_choices():
    reply = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_weather","parameters":{"city":"Rome"}}]'
    whole, chunks, client = chat([reply[i:i + 5] for i in range(0, len(reply), 5)],
                                 {"tool_choice": "required", "n": 2})
    expected = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
                for c in ("Oslo", "Rome")]
    for index in (0, 1):
        choice = whole["choices"][index]
        assert without_ids(choice["message"]["tool_calls"]) == expected and choice["finish_reason"] == "tool_calls"
        content, calls, finish = folded(chunks, index)
        assert content == "" and without_ids(calls) == expected and finish == "tool_calls"
    assert json.loads(client.params[0].structured.spec)["type"] == "array"


def test_auto_with_a_parser_finds_the_calls_after_text():
    pieces = ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": ', '"Oslo"}}',
              "</tool_call>"]
    whole, chunks, client = chat(pieces, {}, ToolOptions(parser="hermes"))
    message = whole["choices"][0]["message"]
    expected = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert message["content"] == "Let me check. " and without_ids(message["tool_calls"]) == expected
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    content, calls, finish = folded(chunks)
    assert (content, without_ids(calls), finish) == ("Let me check. ", expected, "tool_calls")
    sent = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    assert [d["function"]["arguments"] for d in sent] == ['{"city": ', '"Oslo"}']  # (streamed as they came)
    assert client.params[0].structured is None and client.params[0].skip_special_tokens is False
    # tool_choice "none": the same reply is plain content
    whole, chunks, _ = chat(pieces, {"tool_choice": "none"}, ToolOptions(parser="hermes"))
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces),
                                                   **server_app.MESSAGE_NULLS}
    assert folded(chunks) == ("".join(pieces), [], "stop")


def test_a_cut_reply_with_logprobs_comes_back_as_text_with_every_tokens_logprob():
    pieces = ['[{"name":', '"get_wea']
    whole, chunks, _ = chat(pieces, {"tool_choice": "required", "logprobs": True}, finish="length")
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "".join(pieces),
                                                   **server_app.MESSAGE_NULLS}
    assert choice["finish_reason"] == "length"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.5, -0.5]
    streamed = [e for c in chunks for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])]
    assert len(streamed) == 2  # (held-back text still sends its tokens' log-probabilities)
    assert folded(chunks) == ("".join(pieces), [], "length")


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_call_cut_off_streams_as_far_as_it_went_and_is_text_whole_as_vllms(finish):
    """max_tokens (or an EOS) cuts a call after a stream sent it: the stream keeps it, its arguments as written (not
    JSON a client may run), with the engine's finish reason, never "tool_calls" (vLLM's stream: "tool_calls" only
    where generation stopped, and its hermes parser streams a cut call's arguments so). The whole reply is what vLLM's
    gives: its hermes parser's json.loads fails on the cut call, so the reply is its text, no call."""
    pieces = ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": ', '"Os']
    whole, chunks, _ = chat(pieces, {}, ToolOptions(parser="hermes"), finish=finish)
    choice = whole["choices"][0]
    expected = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Os'}}]
    assert choice["message"] == {"role": "assistant", "content": "".join(pieces), **server_app.MESSAGE_NULLS}
    assert choice["finish_reason"] == finish
    content, calls, streamed_finish = folded(chunks)
    assert (content, without_ids(calls), streamed_finish) == ("Let me check. ", expected, finish)


def test_earlier_calls_that_do_not_parse_reach_the_template_as_empty_objects():
    """As newest vLLM's _postprocess_messages: an earlier call's arguments that do not parse are {} (with a warning),
    not a 400 that every later turn of the conversation would get too."""
    app = server_app.create_app(ScriptedClient(["x"]), builtin_codec(), ServerMetrics(), "m", 128)
    history = [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo'}}]}]
    (reply,) = post_all(app, [("/v1/chat/completions", {"model": "m", "messages": history})])
    assert reply.status_code == 200, reply.text


def test_a_reasoning_parser_splits_the_thoughts_out_streamed_or_not():
    pieces = ["<think>", "Two and ", "two.</thi", "nk>\n\nFour."]
    whole, chunks, _ = chat(pieces, {}, reasoning="deepseek_r1", tools=False)
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
        "Two and two.", "Two and two.", "\n\nFour.")
    streamed = "".join(ch["delta"].get("reasoning", "") for c in chunks for ch in c["choices"])
    assert streamed == "Two and two." and folded(chunks) == ("\n\nFour.", [], "stop")
    # include_reasoning false (vLLM's): the thoughts are split out and left out
    whole, chunks, _ = chat(pieces, {"include_reasoning": False}, reasoning="deepseek_r1", tools=False)
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (None, None, "\n\nFour.")
    assert not any("reasoning" in ch["delta"] for c in chunks for ch in c["choices"])
    assert folded(chunks) == ("\n\nFour.", [], "stop")
    # without the parser the tags are the reply's text
    whole, _, _ = chat(pieces, {}, tools=False)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces),
                                                   **server_app.MESSAGE_NULLS}


def test_a_reasoning_server_holds_only_the_answer_to_a_grammar():
    """With a reasoning parser, a grammar (here tool_choice required) holds the output after the thoughts only."""
    reply = '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    whole, chunks, client = chat(["Oslo, then.", "</think>", reply], {"tool_choice": "required"},
                                 reasoning="deepseek_r1")
    assert client.params[0].structured_after == "</think>" and client.params[0].structured.kind == "json_schema"
    assert client.params[0].skip_special_tokens  # (this parser's end tag is no special token)
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == "Oslo, then." and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert whole["choices"][0]["finish_reason"] == "tool_calls"


def test_a_prompt_that_closes_the_thoughts_gets_an_answer_held_from_its_start():
    """A final assistant message continued past its thoughts (its last tag </think>): the reply is all answer, so a
    grammar holds it from its first token (waiting for a second </think> left it unheld) and nothing is reasoning."""
    reply = '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    closed = {"tool_choice": "required", "continue_final_message": True, "add_generation_prompt": False,
              "messages": [{"role": "user", "content": "Weather in Oslo?"},
                           {"role": "assistant", "content": "<think>Oslo, then.</think>"}]}
    whole, chunks, client = chat([reply], closed, reasoning="deepseek_r1")
    assert client.params[0].structured_after is None and client.params[0].structured.kind == "json_schema"
    message = whole["choices"][0]["message"]
    assert message["reasoning"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert not any("reasoning" in ch["delta"] for c in chunks for ch in c["choices"])
    # thoughts the final message opens and leaves open: the reply goes on thinking
    opened = {**closed, "messages": [closed["messages"][0], {"role": "assistant", "content": "<think>Oslo"}]}
    whole, _, client = chat([", then.</think>", reply], opened, reasoning="deepseek_r1")
    assert client.params[0].structured_after == "</think>"
    assert whole["choices"][0]["message"]["reasoning"] == ", then."


def test_a_completion_on_a_reasoning_server_is_its_text_whole_with_a_grammar_held_after_the_thoughts():
    """/v1/completions reads no thoughts out (vLLM's completions apply no reasoning parser: the text, tags and all, as
    it comes), but a grammar holds only what follows them, as vLLM's engine holds every structured request under a
    reasoning parser: from the start where the prompt closed them (its last tag </think>), each prompt for itself."""
    client = ScriptedClient(["Hmm.", "</think>", "abc"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128,
                                reasoning=REASONING_PARSERS["deepseek_r1"])
    body = {"model": "m", "prompt": ["Q: <think>", "Q: <think>x</think>"], "max_tokens": 8,
            "structured_outputs": {"regex": "[a-c]+"}}
    whole, streamed = post_all(app, [("/v1/completions", body), ("/v1/completions", {**body, "stream": True})])
    assert whole.status_code == 200, whole.text
    assert [c["text"] for c in whole.json()["choices"]] == ["Hmm.</think>abc"] * 2
    assert "".join(c["choices"][0]["text"] for c in sse_events(streamed.text) if c["choices"]
                   and c["choices"][0]["index"] == 0) == "Hmm.</think>abc"
    assert [p.structured_after for p in client.params] == ["</think>", None] * 2
    assert all(p.structured.kind == "regex" for p in client.params)
    plain = {**body, "structured_outputs": None}  # (no grammar: nothing held)
    assert post_all(app, [("/v1/completions", plain)])[0].status_code == 200
    assert [p.structured_after for p in client.params[4:]] == [None, None]
    codec = builtin_codec()  # (prompts given as ids: read as their text)
    ids = {**body, "prompt": [codec.encode_text(p, False, None) for p in body["prompt"]]}
    assert post_all(app, [("/v1/completions", ids)])[0].status_code == 200
    assert [p.structured_after for p in client.params[6:]] == ["</think>", None]


def test_a_completion_of_bad_token_ids_with_a_grammar_on_a_reasoning_server_is_a_400():
    """Ids read as text to find whether the prompt closed its thoughts are checked first: a negative id overflowed
    the tokenizer's decode (a 500), where every other completion of such ids is refused, naming it."""
    from tpgraph.engine.limits import RequestLimits

    class CheckingClient(ScriptedClient):  # (the bridge's check: the engine's limits)
        def check(self, prompt, params) -> None:
            RequestLimits(vocab_size=258, max_model_len=128, cache_tokens=1024).check(prompt, params)

    client = CheckingClient(["abc"])
    app = server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128,
                                reasoning=REASONING_PARSERS["deepseek_r1"])
    body = {"model": "m", "prompt": [5, -1], "max_tokens": 8, "structured_outputs": {"regex": "[a-c]+"}}
    got = post_all(app, [("/v1/completions", body)])[0]
    assert got.status_code == 400, got.text
    assert "at position 1" in got.json()["error"]["message"] and not client.params


def test_a_special_end_tag_keeps_special_tokens_in_the_text():
    _, _, client = chat(["a</think>b"], {}, reasoning="deepseek_r1+special", tools=False)
    assert client.params[0].skip_special_tokens is False


@pytest.mark.parametrize(("choice", "reply"), [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
])
@pytest.mark.parametrize("reasoning", [None, "deepseek_r1"])
def test_a_forced_call_comes_with_empty_content_as_vllm_gives_it(choice, reply, reasoning):
    """vLLM answers a named or "required" tool choice with content "" beside the calls (not null), thoughts split
    out or not; its stream sends no content beyond the role chunk's "". An "auto" call alone keeps null."""
    pieces = ["Oslo, then.</think>", reply] if reasoning else [reply]
    whole, chunks, _ = chat(pieces, {"tool_choice": choice}, reasoning=reasoning)
    message = whole["choices"][0]["message"]
    assert message["content"] == "" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert folded(chunks)[0] == ""
    auto = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    whole, _, _ = chat([auto], {}, ToolOptions(parser="llama3_json"))
    assert whole["choices"][0]["message"]["content"] is None and whole["choices"][0]["message"]["tool_calls"]


def test_a_tool_name_that_is_no_unicode_text_is_a_400_not_a_500():
    """A tool named with a lone surrogate (JSON's "\\ud800"): where the chat template does not write the tools out
    (Llama 2's, say), nothing refused it, and a named tool_choice's reply, which names the function, could not be
    written as UTF-8: a 500 after the request ran. It is refused, naming the tool."""
    from tpgraph.chat import ChatTemplate
    from tpgraph.tokenizer import BOS

    codec = dataclasses.replace(builtin_codec(), chat_template=ChatTemplate(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", {"bos_token": BOS}))
    client = ScriptedClient(['{"city": "Oslo"}'])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    name = "get_weather\ud800"
    tool = {"type": "function", "function": {**WEATHER["function"], "name": name}}
    (reply,) = post_all(app, [("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": name}}})])
    assert reply.status_code == 400 and "tools[0].function" in reply.json()["error"]["message"]
    assert not client.prompts


def test_reasoning_effort_reaches_the_chat_template_as_vllms():
    """vLLM gives a chat request's reasoning_effort to the template (over chat_template_kwargs' own), with
    enable_thinking false for "none" and true otherwise (unless chat_template_kwargs sets it); here it was dropped
    unsaid, so a client could not turn a model's thinking down or off. A value no template knows is a 400."""
    from tpgraph.chat import ChatTemplate
    from tpgraph.tokenizer import BOS

    codec = dataclasses.replace(builtin_codec(), chat_template=ChatTemplate(
        "{{ reasoning_effort | default('unset') }}|{{ enable_thinking | default('unset') }}|"
        "{% for m in messages %}{{ m.content }}{% endfor %}", {"bos_token": BOS}))
    client = ScriptedClient(["ok"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    messages = [{"role": "user", "content": "x"}]
    bodies = [{}, {"reasoning_effort": "low"}, {"reasoning_effort": "none"},
              {"reasoning_effort": "high",
               "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"}},
              {"reasoning_effort": "extreme"}]
    replies = post_all(app, [("/v1/chat/completions", {"model": "m", "messages": messages, **b}) for b in bodies])
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 400]
    assert "reasoning_effort must be one of" in replies[-1].json()["error"]["message"]
    rendered = ["unset|unset|x", "low|True|x", "none|False|x", "high|False|x"]
    assert client.prompts == [codec.encode_text(text, add_special_tokens=False) for text in rendered]
