"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) in process, on an engine that answers with set
text: the prompt is the chat route's for the same conversation; thinking, text and tool_use blocks whole and as the
stream's events (each parsed by the anthropic SDK's types where it is installed, and folded by its own stream
accumulator); stop reasons; usage with the prefix cache's tokens; and every refusal in Anthropic's error shape."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from tpgtest.copies import CountedText
from tpgtest.server_stubs import ScriptedClient, builtin_codec, httpx_module, post_all, typed_sse_events  # noqa: E402,E501

from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.messages import chat_messages  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS  # noqa: E402
from tpgraph.server.reply import Delta  # noqa: E402
from tpgraph.server.tools import ToolOptions  # noqa: E402

WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Weather in Oslo?"}]}


def make_app(client, reasoning: str | None = None, tools: ToolOptions | None = None, **kw):
    return server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128,
                                 reasoning=REASONING_PARSERS[reasoning] if reasoning else None, tool_options=tools,
                                 **kw)


def typed_events(text: str) -> list[dict]:
    """A Messages stream's events, each naming its type on its event line (and parsed by the SDK's type, if any)."""
    events = typed_sse_events(text)
    try:
        from anthropic.types import RawMessageStreamEvent
        from pydantic import TypeAdapter
    except ImportError:
        return events
    adapter = TypeAdapter(RawMessageStreamEvent)
    for event in events:
        adapter.validate_python(event)
    return events


def reply(pieces: list[str], body: dict, finish: str = "stop", cached: int = 0, stop_reason=None,
          **app_kw) -> tuple[dict, list[dict], ScriptedClient]:
    """The reply whole and as its stream's events, and the engine client that answered both."""
    client = ScriptedClient(pieces, finish, cached=cached, stop_reason=stop_reason)
    whole, streamed = post_all(make_app(client, **app_kw), [("/v1/messages", {**ASK, **body}),
                                                            ("/v1/messages", {**ASK, **body, "stream": True})])
    assert whole.status_code == 200, whole.text
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    try:
        from anthropic.types import Message
    except ImportError:
        pass
    else:
        Message.model_validate(whole.json())
    return whole.json(), typed_events(streamed.text), client


def folded(events: list[dict]) -> tuple[list[dict], dict]:
    """A stream's content blocks and its message_delta, folded as a client does."""
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, block = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    delta = next(e for e in events if e["type"] == "message_delta")
    return blocks, delta


def test_a_text_reply_whole_and_streamed_runs_the_chat_routes_prompt():
    whole, events, client = reply(["Rain", " today."], {"system": "Be brief.", "temperature": 0.5, "top_k": 4,
                                                         "stop_sequences": ["\n\n"]})
    assert whole["type"] == "message" and whole["role"] == "assistant" and whole["id"].startswith("msg_")
    assert whole["content"] == [{"type": "text", "text": "Rain today."}]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("end_turn", None)
    assert whole["usage"]["output_tokens"] == 2 and whole["usage"]["input_tokens"] == len(client.prompts[0])
    params = client.params[0]
    assert (params.temperature, params.top_k, params.stop, params.max_tokens) == (0.5, 4, ("\n\n",), 8)
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]})])
    assert client.prompts == chat.prompts * 2
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    blocks, delta = folded(events)
    assert blocks == whole["content"]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == whole["usage"]


@pytest.mark.parametrize(("finish", "stop_reason", "expected"), [
    ("length", None, ("max_tokens", None)),
    ("stop", "\n\n", ("stop_sequence", "\n\n")),
    ("stop", 7, ("end_turn", None)),  # (a stop token id: no sequence to name)
    # (a sample the engine ended, every token banned: not a turn ended naturally, end_turn, nor the model declining,
    # refusal; null, as vLLM's Messages API tells it)
    ("abort", None, (None, None)),
])
def test_stop_reasons(finish, stop_reason, expected):
    whole, events, _ = reply(["a"], {"stop_sequences": ["\n\n"]}, finish=finish, stop_reason=stop_reason)
    assert (whole["stop_reason"], whole["stop_sequence"]) == expected
    _, delta = folded(events)
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == expected


def test_usage_counts_the_prefix_caches_tokens_apart():
    whole, events, client = reply(["a"], {}, cached=4)
    usage = whole["usage"]
    assert (usage["cache_read_input_tokens"], usage["input_tokens"]) == (4, len(client.prompts[0]) - 4)
    # (the stream's message_start tells the prompt's tokens as the whole message does)
    assert events[0]["message"]["usage"] == {**usage, "output_tokens": 0}


@pytest.mark.parametrize(("choice", "pieces", "mode"), [
    ({"type": "tool", "name": "get_weather"}, ['{"city":', '"Oslo"}'], "named"),
    ({"type": "any"}, ['[{"name":"get_weather",', '"parameters":{"city":"Oslo"}}]'], "required"),
])
def test_a_tool_call_is_a_tool_use_block(choice, pieces, mode):
    whole, events, client = reply(pieces, {"tools": [WEATHER], "tool_choice": choice})
    assert client.params[0].structured is not None
    uses = [b for b in whole["content"] if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in uses] == [("get_weather", {"city": "Oslo"})] and uses[0]["id"]
    # (a named choice's call is a tool_use too: the SDK's tool runner runs a turn's tool_use blocks only where it
    # ends "tool_use", as Anthropic's forced tool choice ends)
    assert whole["stop_reason"] == "tool_use"
    blocks, delta = folded(events)
    assert [(b["type"], b.get("input")) for b in blocks if b["type"] == "tool_use"] == [("tool_use",
                                                                                          {"city": "Oslo"})]
    assert delta["delta"]["stop_reason"] == whole["stop_reason"]


def test_auto_tool_calls_after_text_with_a_parser():
    pieces = ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
              "</tool_call>"]
    whole, events, _ = reply(pieces, {"tools": [WEATHER]}, tools=ToolOptions(parser="hermes"))
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == {"city": "Oslo"} and whole["stop_reason"] == "tool_use"
    blocks, _ = folded(events)
    assert [(b["type"], b.get("text"), b.get("input")) for b in blocks] == [
        (b["type"], b.get("text"), b.get("input")) for b in whole["content"]]


def test_thoughts_are_a_thinking_block():
    whole, events, _ = reply(["Four", " it is.", "</think>", "4"], {}, reasoning="deepseek_r1")
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "Four it is." and whole["content"][1]["text"] == "4"
    blocks, _ = folded(events)
    assert [b.get("thinking") or b.get("text") for b in blocks] == ["Four it is.", "4"]


def test_a_thinking_block_is_signed_whole_and_streamed():
    """A thinking block carries a signature (vLLM's: a made-up one), and a stream sends it in a signature_delta just
    before the block stops, as Anthropic's do, so a client folding the stream gets it to send back."""
    whole, events, _ = reply(["Four.", "</think>", "4"], {}, reasoning="deepseek_r1")
    assert whole["content"][0]["type"] == "thinking" and whole["content"][0]["signature"]
    stop = next(i for i, e in enumerate(events) if e["type"] == "content_block_stop")
    assert events[stop - 1]["delta"]["type"] == "signature_delta" and events[stop - 1]["index"] == 0
    assert events[stop - 1]["delta"]["signature"]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"].count("signature_delta") == 1


def test_a_conversation_with_tools_becomes_the_chats_messages():
    messages = [
        {"role": "system", "content": "And be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "rain"}]},
                                     {"type": "text", "text": "Thanks."}]}]
    assert chat_messages([{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                          {"type": "text", "text": "Be brief. "}], messages) == [
        {"role": "system", "content": "Be brief. And be kind."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "Look it up.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "user", "content": "Thanks."}]


def test_claude_codes_own_roles_are_user_messages():
    """Claude Code (2.1.154 on) sends some user turns as roles "ctx" and "msg", which vLLM reads as "user" (and, as
    consecutive user turns, they are one, as Anthropic's API combines them)."""
    messages = [{"role": "ctx", "content": "Context."}, {"role": "msg", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello."}, {"role": "msg", "content": "Bye"}]
    assert chat_messages(None, messages) == [
        {"role": "user", "content": [{"type": "text", "text": "Context."}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def test_a_final_assistant_message_is_continued():
    client = ScriptedClient([" sunny."])
    body = {**ASK, "messages": [*ASK["messages"], {"role": "assistant", "content": "It is"}]}
    got, = post_all(make_app(client), [("/v1/messages", body)])
    assert got.json()["content"] == [{"type": "text", "text": " sunny."}]
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": body["messages"],
                                                        "add_generation_prompt": False,
                                                        "continue_final_message": True})])
    assert client.prompts == chat.prompts


def test_count_tokens_is_the_prompts_length():
    client = ScriptedClient(["x"])
    app = make_app(client)
    counted, _ = post_all(app, [("/v1/messages/count_tokens", {k: v for k, v in ASK.items() if k != "max_tokens"}),
                                ("/v1/messages", ASK)])
    assert counted.json() == {"input_tokens": len(client.prompts[0])}


def test_the_sdk_reads_a_message_and_its_stream():
    anthropic = pytest.importorskip("anthropic")
    app = make_app(ScriptedClient(["Rain", " today."]), api_key="k3y")
    httpx = httpx_module()

    async def main() -> tuple:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = anthropic.AsyncAnthropic(api_key="k3y", base_url="http://t", http_client=http, max_retries=0)
        whole = await client.messages.create(**ASK)
        async with client.messages.stream(**ASK) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        counted = await client.messages.count_tokens(model="m", messages=ASK["messages"])
        await http.aclose()
        return whole, texts, final, counted

    whole, texts, final, counted = asyncio.run(main())
    assert whole.content[0].text == "Rain today." and texts == ["Rain", " today."]
    assert final.content[0].text == "Rain today." and final.stop_reason == "end_turn"
    assert counted.input_tokens == whole.usage.input_tokens


@pytest.mark.parametrize(("body", "status", "named"), [
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": []}, 400, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0]"),
    # (the MCP connector's servers, whose tools Anthropic's API calls itself: refused as server tools are, not dropped)
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}]}, 400,
     "mcp_servers"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "tool_choice"),
    # (an empty or no name named as sent: not as the chat's {"type": "function", "function": {...}}, which the user
    # never wrote)
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": ""}}, 400, 'tool_choice {"type": "tool"} needs'),
    ({"tools": [{**WEATHER, "name": ""}]}, 400, "tools[0].name must be a non-empty string"),
    ({"tools": [{**WEATHER, "name": 5}]}, 400, "tools[0].name must be a non-empty string"),
    ({"tools": [{"name": "get_weather"}]}, 400, "tools[0].input_schema"),  # (Anthropic's and vLLM's: required)
    ({"tools": [{"name": "get_weather", "input_schema": None}]}, 400, "tools[0].input_schema"),
    # (an input that is no object: Anthropic's API refuses the schema; a forced call's input came back
    # {"arguments": ...}, no input the schema described)
    ({"tools": [{"name": "get_weather", "input_schema": {"type": "string"}}]}, 400, "tools[0].input_schema.type"),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice needs tools"),  # (not dropped: a call asked for, unsaid)
    ({"stop": ["\n"]}, 400, "stop_sequences"),  # (the chat's stop: not dropped for an absent stop_sequences)
    ({"stop_sequences": ["\n", ""]}, 400, "stop_sequences"),  # (named as sent, not as the chat's stop)
    ({"stop_sequences": [f"s{i}" for i in range(101)]}, 400, "stop_sequences holds 101 strings"),  # (nor too many)
    ({"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),  # (no empty user turn)
    ({"messages": [{"role": "user", "content": ""}]}, 400, "messages[0].content"),  # (nor as an empty string)
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "Hi"}]}, 400,
     "messages[0].content"),
    ({"thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [  # (not run as {})
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": "Oslo"}]}]},
     400, "messages[1].content[0].input"),
    ({"max_tokens": True}, 400, "max_tokens"),  # (not run as 1 token, nor true as temperature 1.0)
    ({"temperature": True}, 400, "temperature"),
    ({"output_config": {"effort": "huge"}}, 400, "output_config.effort"),  # (not handed to the template unsaid)
    ({"temperature": 3}, 400, "temperature"),
    ({"model": "other"}, 404, "other"),
    ({"output_config": {"format": "json"}}, 400, "output_config.format"),
    ({"output_config": {"format": {"type": "xml", "schema": {"type": "object"}}}}, 400, "output_config.format"),
    # (a format with no schema, or one that is no object: not run unconstrained unsaid, nor named as the chat's field)
    ({"output_config": {"format": {"type": "json_schema"}}}, 400, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": 5}}}, 400, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": None}}, 400, "output_format.schema"),
    # (vLLM's fields the chat route refuses, not served: taken beside SAMPLING_EXTRAS' and refused alike, not dropped)
    ({"thinking_token_budget": 100}, 400, "thinking_token_budget is not supported"),
    ({"logprob_token_ids": [5]}, 400, "logprob_token_ids is not supported"),
    ({"structural_tag": "{}"}, 400, "structural_tag is not supported"),
])
def test_refusals_take_anthropics_error_shape(body, status, named):
    client = ScriptedClient(["a"])
    got, = post_all(make_app(client), [("/v1/messages", {**ASK, **body})])
    assert got.status_code == status, got.text
    error = got.json()
    assert error["type"] == "error" and named in error["error"]["message"]
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert client.params == []


def test_the_anthropic_api_key_header_is_taken():
    client = ScriptedClient(["a"])
    app = make_app(client, api_key="k3y")
    keyed, bare = post_all(app, [("/v1/messages", ASK)], headers={"x-api-key": "k3y"}) + \
        post_all(app, [("/v1/messages", ASK)])
    assert keyed.status_code == 200 and bare.status_code == 401


def test_a_calls_last_arguments_beside_text_stay_in_its_tool_use_block():
    """A streamed piece that ends a call's arguments and goes on with text: the arguments' delta belongs to the open
    tool_use block (sent before the text's block starts), so the SDK's accumulator reads the call's whole input."""
    anthropic = pytest.importorskip("anthropic")
    pieces = ["[get_weather(city='Oslo', ", "unit='c')] Done."]
    whole, events, _ = reply(pieces, {"tools": [WEATHER]}, tools=ToolOptions(parser="pythonic"))
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            assert next(s for s in events if s["type"] == "content_block_start" and s["index"] == e["index"]
                        )["content_block"]["type"] == "tool_use"
    app = make_app(ScriptedClient(pieces), tools=ToolOptions(parser="pythonic"))
    httpx = httpx_module()

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = anthropic.AsyncAnthropic(api_key="x", base_url="http://t", http_client=http, max_retries=0)
        async with client.messages.stream(**ASK, tools=[WEATHER]) as stream:
            final = await stream.get_final_message()
        await http.aclose()
        return final

    final = asyncio.run(main())
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Oslo", "unit": "c"}]
    assert [b["input"] for b in whole["content"] if b["type"] == "tool_use"] == [{"city": "Oslo", "unit": "c"}]


def test_a_messages_text_blocks_are_the_chats_text_parts():
    """Several text blocks in a message reach the template as the chat's text parts do (vLLM hands them over as
    parts, joined by newlines for a template that takes a string), not glued together."""
    blocks = [{"type": "text", "text": "<reminder>Be brief.</reminder>"}, {"type": "text", "text": "Weather?"}]
    client = ScriptedClient(["x"])
    post_all(make_app(client), [("/v1/messages", {**ASK, "messages": [
        {"role": "user", "content": blocks}, {"role": "assistant", "content": blocks},
        {"role": "user", "content": "And tomorrow?"}]})])
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": blocks}, {"role": "assistant", "content": blocks},
        {"role": "user", "content": "And tomorrow?"}]})])
    assert client.prompts == chat.prompts


@pytest.mark.parametrize("kind", ["adaptive", "between_tools"])
def test_thinking_the_model_decides_on_is_taken(kind):
    """thinking types the SDK sends where the model decides when to think are taken (vLLM takes any thinking): the
    template's own default, as with no thinking field."""
    client = ScriptedClient(["a"])
    got, plain = post_all(make_app(client), [("/v1/messages", {**ASK, "thinking": {"type": kind}}),
                                             ("/v1/messages", ASK)])
    assert got.status_code == 200, got.text
    assert client.prompts[0] == client.prompts[1]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_body_that_is_no_utf8_is_a_400(path):
    """A body that does not decode (json.loads raises UnicodeDecodeError, no JSONDecodeError) is refused in Anthropic's
    shape, as the chat route refuses it, not a 500."""
    httpx = httpx_module()
    app = make_app(ScriptedClient(["a"]))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, content=b'{"model": "\xff"}', headers={"content-type": "application/json"})

    got = asyncio.run(main())
    assert got.status_code == 400 and got.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("body", [b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, b"[" * 100_000],
                         ids=["objects", "arrays"])
def test_a_body_nested_past_the_json_readers_depth_is_a_400(path, body):
    """json.loads raises RecursionError (no ValueError) on a body nested some thousands deep: the Messages API's reader
    let it through as a 500 (api_error). The chat route refuses such a body with a 400."""
    httpx = httpx_module()
    app = make_app(ScriptedClient(["a"]))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, content=body, headers={"content-type": "application/json"})

    got = asyncio.run(main())
    assert got.status_code == 400 and got.json()["error"]["type"] == "invalid_request_error", got.text
    assert "nested too deeply" in got.json()["error"]["message"]


@pytest.mark.parametrize("pieces", [["[get_weather(city='Oslo')] Done."],  # (the call and the text in one piece)
                                    ["[get_weather(", "city='Oslo')]", " Done."]])
def test_text_after_a_call_comes_after_its_tool_use_block(pieces):
    """Content blocks keep the order the model wrote them in, whole or streamed, also where the call and the text
    after it come in one piece (a whole reply's calls and text are read at once, at its end)."""
    whole, events, _ = reply(pieces, {"tools": [WEATHER]}, tools=ToolOptions(parser="pythonic"))
    assert [(b["type"], b.get("text"), b.get("input")) for b in whole["content"]] == [
        ("tool_use", None, {"city": "Oslo"}), ("text", " Done.", None)]
    blocks, _ = folded(events)
    assert [(b["type"], b.get("text"), b.get("input")) for b in blocks] == [
        (b["type"], b.get("text"), b.get("input")) for b in whole["content"]]


@pytest.mark.parametrize(("method", "path", "headers", "status", "kind"), [
    ("POST", "/v1/messages", {}, 401, "authentication_error"),
    ("POST", "/v1/messages", {"x-api-key": "wrong"}, 401, "authentication_error"),
    ("POST", "/v1/messages/count_tokens", {"Authorization": "Bearer wrong"}, 401, "authentication_error"),
    ("GET", "/v1/messages", {"x-api-key": "k3y"}, 405, "invalid_request_error"),
    ("POST", "/v1/messages/batches", {"x-api-key": "k3y"}, 404, "not_found_error"),
])
def test_refusals_before_the_messages_routes_take_anthropics_error_shape(method, path, headers, status, kind):
    """A request the key's check or the router refuses before the Messages API's routes read it is refused in
    Anthropic's shape too (its clients read the error's type and message from it); the chat API's in OpenAI's."""
    client = ScriptedClient(["a"])
    app = make_app(client, api_key="k3y")
    httpx = httpx_module()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return (await http.request(method, path, json=ASK, headers=headers),
                    await http.post("/v1/chat/completions", json=ASK))

    got, chat = asyncio.run(main())
    assert got.status_code == status
    error = got.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]
    assert chat.status_code == 401 and chat.json()["error"]["type"] == "AuthenticationError"
    assert client.params == []


class BrokenClient(ScriptedClient):
    """An engine whose submit fails unexpectedly (no refusal: a bug's exception)."""

    def submit(self, request_id, prompt, params, sink) -> None:
        raise RuntimeError("boom")


@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_failure_is_a_500_in_anthropics_shape(stream):
    """As vLLM's Messages router answers any exception: Anthropic's error shape, not Starlette's plain text."""
    httpx = httpx_module()
    app = make_app(BrokenClient(["a"]))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post("/v1/messages", json={**ASK, "stream": stream})

    got = asyncio.run(main())
    assert got.status_code == 500
    assert got.json() == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


@pytest.mark.parametrize("delta", [lambda text: Delta(reasoning=text), lambda text: Delta(text),
                                   lambda text: Delta(calls=[{"index": 0, "function": {"arguments": text}}])],
                         ids=["thinking", "text", "arguments"])
def test_a_long_replys_blocks_grow_with_no_work_per_token_that_grows(delta):
    # (each token's text must not copy the block's text so far: a long reply's blocks stay linear to fold)
    from tpgraph.server.messages import ContentBlocks

    blocks = ContentBlocks()
    blocks.add(Delta(calls=[{"index": 0, "id": "c0", "function": {"name": "f", "arguments": ""}}]))
    CountedText.before = 0
    for _ in range(2000):
        blocks.add(delta(CountedText("ab")))
    blocks.finish()
    last = blocks.blocks[-1]
    written = {"tool_use": lambda: last["input"]["arguments"], "text": lambda: last["text"],
               "thinking": lambda: last["thinking"]}[last["type"]]()
    assert written == "ab" * 2000 and CountedText.before == 0


def refusals_of_both_routes(body: dict) -> list[str]:
    """ASK with `body` on /v1/messages and on count_tokens: each a 400 (nothing reaching the engine), their
    messages."""
    client = ScriptedClient(["a"])
    routes = ("/v1/messages", "/v1/messages/count_tokens")
    got = post_all(make_app(client), [(path, {**ASK, **body}) for path in routes])
    for response in got:
        assert response.status_code == 400, response.text
    assert client.params == []
    return [response.json()["error"]["message"] for response in got]


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": [{"type": "text", "text": ""}]}]},
     "messages[1].content[0]"),  # (a prefill's empty block too)
    ({"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": ""}]}, "system[1]"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": ""}]}]}]},
     "messages[2].content[0].content[0]"),
])
def test_an_empty_text_block_is_refused_as_anthropics_api_refuses_it(body, named):
    """Anthropic's API refuses a text block with no text (400 "text content blocks must be non-empty") wherever it
    stands, rather than taking it into the prompt (or dropping it unsaid)."""
    for message in refusals_of_both_routes(body):
        assert named in message and "text content blocks must be non-empty" in message


@pytest.mark.parametrize(("where", "stream", "logged"), [
    ("submit", False, "a request's set-up"), ("submit", True, "a request's set-up"),
    ("reply", False, "a whole reply"), ("reply", True, "a stream after it began")])
def test_an_unexpected_failure_is_logged_as_what_failed(where, stream, logged, monkeypatch, caplog):
    """The log of a bug's failure names what failed: the request's set-up (before any reply), a whole reply, or a
    stream after its 200 went out; not every one as a stream's."""
    from tpgraph.server import messages

    def broken(self, delta):
        raise RuntimeError("boom")

    if where == "reply":
        monkeypatch.setattr(messages.ContentBlocks, "add", broken)
    httpx = httpx_module()
    app = make_app((BrokenClient if where == "submit" else ScriptedClient)(["a"]))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post("/v1/messages", json={**ASK, "stream": stream})

    with caplog.at_level("ERROR"):
        got = asyncio.run(main())
    assert "boom" in got.text
    failures = [r.getMessage() for r in caplog.records if r.exc_info]
    assert len(failures) == 1 and logged in failures[0], failures


def test_a_tools_input_schema_without_a_type_is_an_object_schema():
    """An input_schema that leaves out its type is read as an object's (vLLM's AnthropicTool): a tool's input is an
    object, so a forced call's arguments are constrained to one, not to any JSON value."""
    tool = {"name": "get_weather", "input_schema": {"properties": {"city": {"type": "string"}}}}
    _, _, client = reply(['{"city":', '"Oslo"}'], {"tools": [tool], "tool_choice": {"type": "tool",
                                                                                   "name": "get_weather"}})
    assert json.loads(client.params[0].structured.spec) == {"type": "object", **tool["input_schema"]}


def test_the_beta_output_format_holds_the_reply_as_output_config_format_does():
    """output_format, the name Anthropic's structured outputs beta gave output_config.format (which Anthropic still
    takes), was left in the extras and dropped: the reply ran unconstrained. It is read as output_config.format;
    both at once are refused, as another format is."""
    from tpgraph.engine.structured import StructuredOutput

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "schema": schema}
    for body in ({"output_format": fmt}, {"output_config": {"format": fmt}}):
        _, _, client = reply(['{"city": "Oslo"}'], body)
        assert client.params[0].structured == StructuredOutput.json_schema(schema), body
    client = ScriptedClient(["a"])
    both, other = post_all(make_app(client), [
        ("/v1/messages", {**ASK, "output_format": fmt, "output_config": {"format": fmt}}),
        ("/v1/messages", {**ASK, "output_format": {"type": "xml"}})])
    assert both.status_code == other.status_code == 400 and client.params == []
    assert "output_config.format and output_format" in both.json()["error"]["message"]
    assert other.json()["error"]["message"].startswith("output_format must be")


def test_an_empty_system_prompt_is_no_system_prompt():
    """system "" is no system prompt (vLLM's reading: its system is taken only where it has text), not an empty
    system turn the template renders into the prompt."""
    client = ScriptedClient(["a"])
    post_all(make_app(client), [("/v1/messages", {**ASK, "system": ""}), ("/v1/messages", ASK)])
    assert client.prompts[0] == client.prompts[1]


def test_output_config_effort_reaches_the_template_as_a_chat_requests_reasoning_effort_does():
    """Messages run as a chat request, and output_config.effort is its reasoning_effort (vLLM's Anthropic route sets
    the chat request's reasoning_effort): the template gets reasoning_effort, and enable_thinking true unless
    thinking.type sets it (as a chat request's chat_template_kwargs do). It went in as chat_template_kwargs'
    reasoning_effort alone, a second way to give a template an effort, which left enable_thinking unset."""
    import dataclasses

    from tpgraph.chat import ChatTemplate
    from tpgraph.tokenizer import BOS

    codec = dataclasses.replace(builtin_codec(), chat_template=ChatTemplate(
        "{{ reasoning_effort | default('unset') }}|{{ enable_thinking | default('unset') }}|"
        "{% for m in messages %}{{ m.content }}{% endfor %}", {"bos_token": BOS}))
    client = ScriptedClient(["ok"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    bodies = [{}, {"output_config": {"effort": "low"}},
              {"output_config": {"effort": "max"}, "thinking": {"type": "disabled"}},
              {"output_config": {"effort": "high"}, "chat_template_kwargs": {"reasoning_effort": "low"}},
              {"thinking": {"type": "enabled"}}]
    ask = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    replies = post_all(app, [("/v1/messages", {**ask, **b}) for b in bodies])
    assert [r.status_code for r in replies] == [200] * len(bodies)
    rendered = ["unset|unset|x", "low|True|x", "max|False|x", "high|True|x", "unset|True|x"]
    assert client.prompts == [codec.encode_text(text, add_special_tokens=False) for text in rendered]


def test_an_empty_tools_list_runs_as_the_chats_does():
    """tools [] with no tool_choice (which some clients always send) is no tool to call: the chat route runs it plain,
    and so does this one. It was sent on as tool_choice "auto", which a server with no tool parser refused."""
    client = ScriptedClient(["a"])
    got, = post_all(make_app(client), [("/v1/messages", {**ASK, "tools": []})])
    assert got.status_code == 200, got.text
    assert got.json()["content"] == [{"type": "text", "text": "a"}] and got.json()["stop_reason"] == "end_turn"
    chat = ScriptedClient(["a"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": ASK["messages"], "tools": []})])
    assert client.prompts == chat.prompts


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text must be a string"),
    ({"system": [{"type": "text", "text": None}]}, "system[0].text must be a string"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "thinking"}]}]},
     "messages[1].content[0].thinking must be a string"),
])
def test_a_malformed_block_is_refused_by_its_field_not_as_a_kind_not_taken(body, named):
    """A text block without a string text (or an assistant's thinking block without its thoughts) was refused as
    "a 'text' block is not taken in a user message; this server serves a text model", which sent the user looking
    for some other kind of block; the refusal names the field that is wrong."""
    client = ScriptedClient(["a"])
    got, = post_all(make_app(client), [("/v1/messages", {**ASK, **body})])
    assert got.status_code == 400, got.text
    message = got.json()["error"]["message"]
    assert named in message and "not taken" not in message
    assert client.params == []


def test_a_custom_tool_whose_type_is_null_is_a_custom_tool():
    """A custom tool's type is nullable in Anthropic's API (the SDKs' Tool.type: "custom" or null), and the SDK's Tool
    model dumped with its nulls sends "type": null; it was refused as a server tool ("not run by this server")."""
    tool = {**WEATHER, "type": None, "cache_control": None}
    _, _, client = reply(['{"city":', '"Oslo"}'], {"tools": [tool], "tool_choice": {"type": "tool",
                                                                                   "name": "get_weather"}})
    assert json.loads(client.params[0].structured.spec) == WEATHER["input_schema"]


def test_thinking_display_omitted_sends_signed_empty_thinking_blocks():
    """thinking.display "omitted" (Anthropic's) asks for the thinking blocks without their thoughts: each comes back
    with thinking "" and its signature, whole and streamed (no thinking_delta), the answer as it is. The thoughts were
    sent whatever it said. Another display is refused by name."""
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    whole, events, _ = reply(["Four", " it is.", "</think>", "4"], {"thinking": thinking}, reasoning="deepseek_r1")
    assert [(b["type"], b.get("thinking"), b.get("text")) for b in whole["content"]] == [
        ("thinking", "", None), ("text", None, "4")]
    assert whole["content"][0]["signature"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert "thinking_delta" not in deltas and deltas.count("signature_delta") == 1
    blocks, _ = folded(events)
    assert [(b["type"], b.get("thinking"), b.get("text")) for b in blocks] == [("thinking", "", None), ("text", None,
                                                                                                       "4")]
    shown, _, _ = reply(["Four.", "</think>", "4"], {"thinking": {**thinking, "display": "summarized"}},
                        reasoning="deepseek_r1")
    assert shown["content"][0]["thinking"] == "Four."
    client = ScriptedClient(["a"])
    got, = post_all(make_app(client), [("/v1/messages", {**ASK, "thinking": {**thinking, "display": "hidden"}})])
    assert got.status_code == 400 and "thinking.display" in got.json()["error"]["message"] and client.params == []


@pytest.mark.parametrize("prefill", ["It is", [{"type": "text", "text": "It is"}]])
def test_a_prefill_is_continued_as_answer_on_a_reasoning_server(prefill):
    """A final assistant message of text is the answer begun (Anthropic's prefill): the reply goes on with it as text.
    On a reasoning server it was read as thoughts (the prompt closes none), so the reply came back as a thinking
    block alone, no text. An empty prefill opens the turn as ever, thoughts first."""
    body = {"messages": [*ASK["messages"], {"role": "assistant", "content": prefill}]}
    whole, events, _ = reply([" sunny", "."], body, reasoning="deepseek_r1")
    assert whole["content"] == [{"type": "text", "text": " sunny."}]
    blocks, _ = folded(events)
    assert blocks == whole["content"]
    empty = {"messages": [*ASK["messages"], {"role": "assistant", "content": ""}]}
    whole, _, _ = reply(["Hm.", "</think>", "Yes."], empty, reasoning="deepseek_r1")
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]


ALTERNATING = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}")


def test_consecutive_turns_of_a_role_are_one_turn_as_anthropics_api_combines_them():
    """Anthropic's API combines consecutive user (or assistant) turns into one turn; they reached the template as
    turns of their own, which a template that asks for strict alternation refused (400) where Anthropic serves the
    request. A user's tool results still come first, as tool messages, then the merged turn's text."""
    import dataclasses

    from tpgraph.chat import ChatTemplate
    from tpgraph.tokenizer import BOS

    codec = dataclasses.replace(builtin_codec(), chat_template=ChatTemplate(ALTERNATING, {"bos_token": BOS}))
    client = ScriptedClient(["ok"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    messages = [{"role": "user", "content": "Hi."}, {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": "Let me see."}, {"role": "assistant", "content": "Rain."},
                {"role": "user", "content": "Thanks."}]
    got, counted = post_all(app, [("/v1/messages", {**ASK, "messages": messages}),
                                  ("/v1/messages/count_tokens", {"model": "m", "messages": messages})])
    assert got.status_code == 200, got.text
    assert counted.json() == {"input_tokens": len(client.prompts[0])}
    assert chat_messages(None, messages) == [
        {"role": "user", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, {"type": "text", "text": "Rain."}]},
        {"role": "user", "content": "Thanks."}]
    # (a system message between two user turns leaves them consecutive; tool results go first as they always do)
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    assert chat_messages(None, [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}]},
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "So?"}]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"}, {"role": "user", "content": "So?"}]
    # (a refusal still names the block as the user wrote it, in its own message)
    bad = [{"role": "user", "content": "Hi."}, {"role": "user", "content": [{"type": "text", "text": ""}]}]
    with pytest.raises(Exception, match=r"messages\[1\]\.content\[0\]"):
        chat_messages(None, bad)


def test_every_messages_reply_carries_anthropics_request_id_header():
    """Anthropic's SDKs read a reply's id from its request-id header (message._request_id, an APIError's request_id);
    the server sent none (X-Request-Id alone, and only with --enable-request-id-headers). Each Messages reply carries
    it, whole, streamed or refused, before or in the route: the client's X-Request-Id where it sent one (the message's
    id is msg_ and it), else one made for it."""
    anthropic = pytest.importorskip("anthropic")
    client = ScriptedClient(["a"])
    app = make_app(client, api_key="k3y")
    key = {"x-api-key": "k3y"}
    whole, streamed, refused = post_all(app, [("/v1/messages", ASK), ("/v1/messages", {**ASK, "stream": True}),
                                              ("/v1/messages", {**ASK, "max_tokens": 0})], headers=key)
    unkeyed, = post_all(app, [("/v1/messages/count_tokens", ASK)])
    for response in (whole, streamed, refused, unkeyed):
        assert len(response.headers.get("request-id", "")) == 32, response.headers
    assert whole.json()["id"] == "msg_" + whole.headers["request-id"]
    traced, = post_all(app, [("/v1/messages", ASK)], headers={**key, "X-Request-Id": "trace-7"})
    assert traced.headers["request-id"] == "trace-7" and traced.json()["id"] == "msg_trace-7"
    chat, = post_all(app, [("/v1/chat/completions", ASK)], headers=key)  # (the chat API's as ever: no header)
    assert "request-id" not in chat.headers and "x-request-id" not in chat.headers
    httpx = httpx_module()

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        sdk = anthropic.AsyncAnthropic(api_key="k3y", base_url="http://t", http_client=http, max_retries=0)
        message = await sdk.messages.create(**ASK)
        try:
            await sdk.messages.create(**{**ASK, "max_tokens": 0})
        except anthropic.BadRequestError as exc:
            error = exc
        await http.aclose()
        return message, error

    message, error = asyncio.run(main())
    assert message._request_id == message.id.removeprefix("msg_") and error.request_id


@pytest.mark.parametrize("fmt", ["output_config", "output_format"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_format_beside_a_forced_tool_choice_is_refused_in_the_messages_words(fmt, choice):
    """A JSON format beside a tool_choice that forces a call is refused (the call's schema holds the reply): it was
    refused in the chat's words ("tool_choice 'required' ... response_format"), fields the user never wrote."""
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    body = {"tools": [WEATHER], "tool_choice": choice,
            **({"output_config": {"format": schema}} if fmt == "output_config" else {"output_format": schema})}
    name = "output_config.format" if fmt == "output_config" else "output_format"
    for message in refusals_of_both_routes(body):
        assert name in message and json.dumps(choice) in message, message
        assert "response_format" not in message and "required" not in message and "named" not in message


@pytest.mark.parametrize("choice", [None, {"type": "auto"}])
def test_tools_on_a_server_without_a_tool_parser_are_refused_naming_the_messages_choices(choice):
    """Tools with the default (or auto) tool_choice on a server started without a tool-call parser are refused, as
    the chat's are; the refusal sent the Messages user to tool_choice "required", no value of Anthropic's tool_choice:
    it names {"type": "any"} and {"type": "tool"}, which need no parser."""
    client = ScriptedClient(["a"])
    body = {**ASK, "tools": [WEATHER], **({} if choice is None else {"tool_choice": choice})}
    got, = post_all(make_app(client), [("/v1/messages", body)])
    assert got.status_code == 400
    message = got.json()["error"]["message"]
    assert "--tool-call-parser" in message and '{"type": "any"}' in message and '{"type": "tool"' in message
    assert '"required"' not in message
    chat, = post_all(make_app(client), [("/v1/chat/completions", {"model": "m", "messages": ASK["messages"],
                                                                   "tools": [{"type": "function", "function": {
                                                                       "name": "f", "parameters": {}}}]})])
    assert '"required"' in chat.json()["error"]["message"]  # (the chat's own words, its own values)


def test_too_many_tools_for_a_forced_call_are_refused_in_the_messages_words():
    """tool_choice {"type": "any"} with more tools than one grammar takes is refused; the refusal named tool_choice
    "required", the chat's value, which the Messages user never wrote (as the parser refusal once did)."""
    from tpgraph.engine.structured import MAX_SCHEMA_BRANCHES

    client = ScriptedClient(["a"])
    tools = [{**WEATHER, "name": f"tool_{i}"} for i in range(MAX_SCHEMA_BRANCHES + 1)]
    got, = post_all(make_app(client), [("/v1/messages", {**ASK, "tools": tools, "tool_choice": {"type": "any"}})])
    assert got.status_code == 400
    message = got.json()["error"]["message"]
    assert f"at most {MAX_SCHEMA_BRANCHES} tools" in message and '"required"' not in message, message
