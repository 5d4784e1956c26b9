"""OpenAI's Responses API (/v1/responses) in process, on an engine that answers with set text: the prompt is the chat
route's for the same messages; output items (reasoning, message, function calls) whole and as the stream's typed
events, each checked against the openai SDK's own types; stored responses, continued, read back, deleted; background
responses and their cancel; and every refusal a 400 that names the field."""

import asyncio
import json
import typing

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter, ValidationError  # noqa: E402
from tpgtest.copies import CountedText  # noqa: E402
from tpgtest.server_stubs import (  # noqa: E402
    EndlessClient,
    ScriptedClient,
    builtin_codec,
    httpx_module,
    post_all,
    typed_sse_events,
)

from tpgraph.engine.updates import REFUSED, StepUpdate  # noqa: E402
from tpgraph.errors import RequestError  # noqa: E402
from tpgraph.server import app as server_app  # noqa: E402
from tpgraph.server.metrics import ServerMetrics  # noqa: E402
from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS  # noqa: E402
from tpgraph.server.reply import Delta  # noqa: E402
from tpgraph.server.response_store import ResponseStore  # noqa: E402
from tpgraph.server.responses import chat_messages  # noqa: E402
from tpgraph.server.tools import ToolOptions  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# the SDK's stream event types, by their type field
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: TypeAdapter(cls)
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
RESPONSE = TypeAdapter(Response)


def make_app(client, reasoning: str | None = None, store: ResponseStore | None = None, tools: ToolOptions = None):
    return server_app.create_app(client, builtin_codec(), ServerMetrics(), "m", 128,
                                 reasoning=REASONING_PARSERS[reasoning] if reasoning else None,
                                 tool_options=tools, responses_store=store)


# what the SDK's newest types ask that this server does not know: the tokens a prompt wrote to a prompt cache (vLLM's
# replies leave it out too)
UNKNOWN_FIELDS = ("cache_write_tokens",)


def sdk_checked(adapter: TypeAdapter, obj: dict) -> None:
    """obj parses as the SDK's type, but for the fields this server cannot fill."""
    try:
        adapter.validate_python(obj)
    except ValidationError as exc:
        problems = [e for e in exc.errors() if not (e["type"] == "missing" and e["loc"][-1] in UNKNOWN_FIELDS)]
        assert not problems, problems


def typed_events(text: str) -> list[dict]:
    """A Responses stream's events, each checked: its event line names its type, and the SDK's types parse it."""
    events = typed_sse_events(text)
    for event in events:
        sdk_checked(EVENTS[event["type"]], event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def respond(pieces: list[str], body: dict, finish: str = "stop", **app_kw) -> tuple[dict, list[dict], ScriptedClient]:
    """The response whole and as its stream's events, and the engine client that answered both."""
    client = ScriptedClient(pieces, finish)
    request = {"model": "m", **body}
    whole, streamed = post_all(make_app(client, **app_kw), [("/v1/responses", request),
                                                             ("/v1/responses", {**request, "stream": True})])
    assert whole.status_code == 200, whole.text
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    sdk_checked(RESPONSE, whole.json())
    return whole.json(), typed_events(streamed.text), client


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_a_text_reply_whole_and_streamed_runs_the_chat_routes_prompt():
    whole, events, client = respond(["Hel", "lo"], {"input": "Hi there", "instructions": "Be brief."})
    assert whole["status"] == "completed" and whole["object"] == "response" and whole["id"].startswith("resp_")
    assert without_ids(whole["output"]) == [{"type": "message", "role": "assistant", "status": "completed",
                                             "content": [{"type": "output_text", "text": "Hello", "annotations": [],
                                                          "logprobs": []}]}]
    usage = whole["usage"]
    assert (usage["output_tokens"], usage["input_tokens"]) == (2, len(client.prompts[0]))
    assert usage["total_tokens"] == usage["input_tokens"] + 2
    # the engine got the prompt the chat route renders for the same messages
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]})])
    assert client.prompts == chat.prompts * 2
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def test_max_output_tokens_cuts_the_response_incomplete():
    whole, events, client = respond(["a", "b"], {"input": "x", "max_output_tokens": 2}, finish="length")
    assert client.params[0].max_tokens == 2
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


def test_a_sample_the_engine_aborted_is_no_completed_response():
    # (as vLLM's: an "abort" finish (the engine ended the sample: every token its grammar or bans allowed was
    # banned) makes the response "cancelled", its last item cut short, not "completed" as if the model had finished;
    # the stream still ends with response.completed, as vLLM's, since OpenAI's stream has no response.cancelled)
    whole, events, _ = respond(["a", "b"], {"input": "x"}, finish="abort")
    assert whole["status"] == "cancelled" and whole["incomplete_details"] is None
    assert whole["output"][0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2


def test_sampling_fields_logprobs_and_text_format_reach_the_engine():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    whole, events, client = respond(["{", "}"], {
        "input": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "top_logprobs": 1,
        "include": ["message.output_text.logprobs"], "text": {"format": {"type": "json_schema", "name": "a",
                                                                         "schema": schema}}})
    params = client.params[0]
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.logprobs) == (0.5, 0.9, 7, 3, 1)
    assert params.structured.kind == "json_schema" and json.loads(params.structured.spec) == schema
    logprobs = whole["output"][0]["content"][0]["logprobs"]
    assert [e["logprob"] for e in logprobs] == [-0.5, -0.5] and logprobs[0]["top_logprobs"][0]["logprob"] == -0.5
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    assert streamed == logprobs
    assert (whole["temperature"], whole["top_p"], whole["text"]["format"]["type"]) == (0.5, 0.9, "json_schema")
    # the reasoning settings asked for are echoed back, as OpenAI's (and vLLM's) response gives them
    whole, events, _ = respond(["a"], {"input": "x", "reasoning": {"effort": "low", "summary": "auto"}})
    assert whole["reasoning"] == events[-1]["response"]["reasoning"] == {"effort": "low", "summary": "auto"}
    whole, _, _ = respond(["a"], {"input": "x", "text": {"verbosity": "low"}})
    assert whole["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    # without include, top_logprobs asks for nothing (as vLLM's)
    _, _, client = respond(["a"], {"input": "x", "top_logprobs": 2})
    assert client.params[0].logprobs is None


@pytest.mark.parametrize(("choice", "pieces", "arguments"), [
    ({"type": "function", "name": "get_weather"}, ['{"city":', '"Oslo"}'], '{"city":"Oslo"}'),
    # (a "required" call's arguments are the object's JSON, written out as the chat API writes them)
    ("required", ['[{"name":"get_weather",', '"parameters":{"city":"Oslo"}}]'], '{"city": "Oslo"}'),
])
def test_a_function_call_is_an_output_item(choice, pieces, arguments):
    whole, events, client = respond(pieces, {"input": "Weather in Oslo?", "tools": [WEATHER],
                                             "tool_choice": choice})
    assert client.params[0].structured is not None
    calls = [item for item in whole["output"] if item["type"] == "function_call"]
    assert without_ids(calls) == [{"type": "function_call", "name": "get_weather", "arguments": arguments,
                                   "status": "completed"}]
    assert calls[0]["call_id"] and calls[0]["id"].startswith("fc_")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("get_weather", arguments)]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == arguments


@pytest.mark.parametrize("tools", [{}, {"tools": []}])
def test_tool_choice_auto_without_tools_is_the_default_it_names(tools):
    # (the Responses API's default tool_choice is "auto", with tools or without: SDKs and agents send it explicitly)
    client = ScriptedClient(["a"])
    given, plain = post_all(make_app(client), [("/v1/responses", {"input": "x", "tool_choice": "auto", **tools}),
                                               ("/v1/responses", {"input": "x", **tools})])
    assert given.status_code == 200, given.text
    assert given.json()["tool_choice"] == "auto" and client.prompts[0] == client.prompts[1]


def test_auto_calls_after_text_with_a_parser():
    pieces = ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
              "</tool_call>"]
    whole, events, _ = respond(pieces, {"input": "Weather?", "tools": [WEATHER]}, tools=ToolOptions(parser="hermes"))
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    assert whole["output"][0]["content"][0]["text"] == "Let me check. "
    assert whole["output"][1]["arguments"] == '{"city": "Oslo"}'
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def test_thoughts_are_a_reasoning_item_before_the_message():
    whole, events, _ = respond(["Four", " it is.", "</think>", "4"], {"input": "2+2?"}, reasoning="deepseek_r1")
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Four it is."}]
    assert whole["output"][1]["content"][0]["text"] == "4"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert deltas == ["Four", " it is."]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def test_input_items_become_the_chats_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                          {"type": "input_text", "text": "Oslo?"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Bergen"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]}]
    assert chat_messages(items) == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": "Checking.", "reasoning": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"}]


def test_an_input_messages_text_parts_reach_the_template_as_the_chats_do():
    """vLLM hands a message item's parts to its chat parser, which joins them by newlines for a template that takes a
    string: [input_text "Summarize:", input_text "<doc>"] is "Summarize:\n<doc>", as the same parts sent to
    /v1/chat/completions are. They were glued into "Summarize:<doc>", a prompt vLLM never renders; a tool's output
    in parts alike."""
    parts = [{"type": "input_text", "text": "Summarize:"}, {"type": "input_text", "text": "The sky is blue."}]
    output = [{"type": "input_text", "text": "rain"}, {"type": "input_text", "text": "wind"}]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    client = ScriptedClient(["a"])
    result = {"type": "function_call_output", "call_id": "c1", "output": output}
    post_all(make_app(client), [("/v1/responses", {"input": [{"role": "user", "content": parts}, call, result]})])
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "Summarize:\nThe sky is blue."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain\nwind"}]})])
    assert client.prompts and client.prompts == chat.prompts


@pytest.mark.parametrize("status", ["incomplete", "in_progress"])
def test_a_last_assistant_message_not_finished_is_continued(status):
    # (as vLLM's partial message completion: the reply goes on with that message, no new turn opened after it)
    partial = {"type": "message", "role": "assistant", "status": status,
               "content": [{"type": "output_text", "text": "Once upon"}]}
    client = ScriptedClient(["a"])
    done, = post_all(make_app(client), [("/v1/responses", {"input": [{"role": "user", "content": "A story?"},
                                                                       partial]})])
    assert done.status_code == 200, done.text
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "A story?"},
                                   {"role": "assistant", "content": "Once upon"}],
        "add_generation_prompt": False, "continue_final_message": True})])
    assert client.prompts == chat.prompts
    # (a finished one, or one not last, opens the next turn as before)
    finished = ScriptedClient(["a"])
    post_all(make_app(finished), [("/v1/responses", {"input": [{"role": "user", "content": "A story?"},
                                                              {**partial, "status": "completed"}]})])
    assert finished.prompts != chat.prompts


def test_a_stored_response_is_continued_read_back_and_deleted():
    client = ScriptedClient(["Oslo."])
    app = make_app(client)
    first, = post_all(app, [("/v1/responses", {"input": "Capital of Norway?", "instructions": "Be brief."})])
    rid = first.json()["id"]
    second, = post_all(app, [("/v1/responses", {"input": "And Sweden?", "previous_response_id": rid})])
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == rid
    # the continued prompt is the chat of the whole conversation (the first's instructions not carried, as OpenAI's)
    chat = ScriptedClient(["x"])
    post_all(make_app(chat), [("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "Capital of Norway?"}, {"role": "assistant", "content": "Oslo."},
        {"role": "user", "content": "And Sweden?"}]})])
    assert client.prompts[1] == chat.prompts[0]

    async def main() -> list:
        httpx = httpx_module()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            got = await http.get(f"/v1/responses/{rid}")
            deleted = await http.delete(f"/v1/responses/{rid}")
            gone = await http.get(f"/v1/responses/{rid}")
            return [got, deleted, gone]

    got, deleted, gone = asyncio.run(main())
    assert got.json() == first.json()
    assert deleted.json() == {"id": rid, "object": "response", "deleted": True}
    assert gone.status_code == 404 and rid in gone.json()["error"]["message"]
    unknown, = post_all(app, [("/v1/responses", {"input": "x", "previous_response_id": "resp_nope"})])
    assert unknown.status_code == 404 and "resp_nope" in unknown.json()["error"]["message"]
    # (the error names the request's field that named it, as OpenAI's, where clients look for it)
    assert (unknown.json()["error"]["param"], gone.json()["error"]["param"]) == ("previous_response_id", "response_id")


def test_store_false_keeps_nothing_and_the_store_keeps_its_newest():
    store = ResponseStore(capacity=2)
    app = make_app(ScriptedClient(["a"]), store=store)
    replies = post_all(app, [("/v1/responses", {"input": "x", "store": False})]
                       + [("/v1/responses", {"input": str(i)}) for i in range(3)])
    assert len(store) == 2
    oldest = replies[1].json()["id"]
    again, = post_all(app, [("/v1/responses", {"input": "y", "previous_response_id": oldest})])
    assert again.status_code == 404 and "newest 2" in again.json()["error"]["message"]


def test_the_sdk_reads_a_response_and_its_stream():
    app = make_app(ScriptedClient(["Hel", "lo"]))
    httpx = httpx_module()

    async def main() -> tuple:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", http_client=http, max_retries=0)
        whole = await client.responses.create(model="m", input="Hi")
        async with client.responses.stream(model="m", input="Hi") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        await http.aclose()
        return whole, deltas, final

    whole, deltas, final = asyncio.run(main())
    assert whole.output_text == "Hello" and deltas == ["Hel", "lo"] and final.output_text == "Hello"


def test_a_background_response_runs_on_and_is_cancelled():
    client = EndlessClient()
    store = ResponseStore()
    app = make_app(client, store=store)
    httpx = httpx_module()

    async def main() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            created = (await http.post("/v1/responses", json={"input": "x", "background": True})).json()
            for _ in range(500):  # (until it has written a few tokens: a loaded machine's loop may be slow)
                running = (await http.get(f"/v1/responses/{created['id']}")).json()
                if running["output"] and len(running["output"][0]["content"][0]["text"]) >= 2:
                    break
                await asyncio.sleep(0.01)
            cancelled = (await http.post(f"/v1/responses/{created['id']}/cancel")).json()
            again = await http.post(f"/v1/responses/{created['id']}/cancel")
            for t in client.tasks:
                t.cancel()
            return created, running, cancelled, again

    created, running, cancelled, again = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert created["status"] == "queued" and created["background"] is True
    assert running["status"] == "in_progress"
    assert len(running["output"][0]["content"][0]["text"]) >= 2  # (a GET reads what it has written so far)
    assert cancelled["status"] == "cancelled" and len(client.aborted) == 1
    assert cancelled["output"][0]["content"][0]["text"].startswith("xx")  # (what it wrote before the cancel)
    assert cancelled["output"][0]["status"] == "incomplete"  # (not "in_progress": the response is over)
    assert again.status_code == 400 and "already cancelled" in again.json()["error"]["message"]


def test_a_background_response_completes_in_the_store():
    app = make_app(ScriptedClient(["a", "b"]))
    httpx = httpx_module()

    async def main() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            created = (await http.post("/v1/responses", json={"input": "x", "background": True})).json()
            for _ in range(100):
                got = (await http.get(f"/v1/responses/{created['id']}")).json()
                if got["status"] == "completed":
                    return got
                await asyncio.sleep(0.01)
            raise AssertionError(got)

    got = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert got["output"][0]["content"][0]["text"] == "ab" and got["usage"]["output_tokens"] == 2


@pytest.mark.parametrize(("body", "named"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "assistant"}]}, "input[0].content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "max_tool_calls": -1}, "max_tool_calls"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input is empty"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_logprobs": 2, "include": ["message.output_text.logprobs"], "top_k": "a"}, "top_k"),
    ({"input": "x", "include": ["message.output_text.logprob"]}, "include[0]"),  # (a typo: no logprobs, unsaid)
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),  # (echoed back, the SDK could not read it)
    ({"input": "x", "service_tier": "gold"}, "service_tier"),
    ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary"),  # (echoed back too)
    ({"input": "x", "text": {"verbosity": "terse"}}, "text.verbosity"),  # (echoed back too)
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),  # (echoed back)
    # (OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512)
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "structured_outputs": {"regex": "a+"},  # (the Responses API's fields named, not the chat's)
      "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, "structured_outputs and text.format"),
    # (vLLM's fields the chat route refuses, not served: left out of the chat request, they were dropped unsaid)
    ({"input": "x", "logprob_token_ids": [5]}, "logprob_token_ids is not supported"),
    ({"input": "x", "thinking_token_budget": 100}, "thinking_token_budget is not supported"),
    ({"input": "x", "repetition_detection": {"max_pattern_size": 4}}, "repetition_detection is not supported"),
    ({"input": "x", "structural_tag": "{}"}, "structural_tag is not supported"),
    ({"input": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
])
def test_what_cannot_be_honoured_is_a_400_that_names_it(body, named):
    client = ScriptedClient(["a"])
    reply, = post_all(make_app(client), [("/v1/responses", body)])
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]["message"]
    assert client.params == []  # (nothing reached the engine)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}),
    ("/v1/responses", {"input": "x", "include": ["message.output_text.logprobs"]}),
])
def test_too_many_top_logprobs_is_a_400_that_names_top_logprobs(path, body):
    client = ScriptedClient(["a"])
    reply, = post_all(make_app(client), [(path, {"model": "m", **body, "top_logprobs": 21})])
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"].startswith("top_logprobs must be between 0 and 20")
    assert client.params == []


def test_the_store_size_flag_bounds_the_store(capsys):
    from tpgraph.serve import http_options, parse_args

    http = http_options(parse_args(["--responses-store-size", "1"]))
    app = server_app.create_app(ScriptedClient(["a"]), builtin_codec(), ServerMetrics(), "m", 128, http=http)
    first, _ = post_all(app, [("/v1/responses", {"input": "1"}), ("/v1/responses", {"input": "2"})])
    dropped, = post_all(app, [("/v1/responses", {"input": "3", "previous_response_id": first.json()["id"]})])
    assert dropped.status_code == 404 and "newest 1 responses" in dropped.json()["error"]["message"]
    with pytest.raises(SystemExit):
        parse_args(["--responses-store-size", "0"])
    assert "--responses-store-size must be a positive integer, got 0" in capsys.readouterr().err


def get_all(app, paths: list[str]) -> list:
    """GET each path from the app in process, in order."""
    httpx = httpx_module()

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [await http.get(path) for path in paths]

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_the_store_mib_flag_bounds_the_stores_bytes(capsys):
    """The store bounded the number of responses alone: 1024 of long outputs (or top_logprobs, or background event
    logs) held gigabytes. Past --responses-store-mib the oldest goes, a 404 as for one the count dropped."""
    from tpgraph.serve import http_options, parse_args

    http = http_options(parse_args(["--responses-store-mib", "1"]))
    app = server_app.create_app(ScriptedClient(["x" * 400_000]), builtin_codec(), ServerMetrics(), "m", 128, http=http)
    ids = [r.json()["id"] for r in post_all(app, [("/v1/responses", {"input": str(i)}) for i in range(3)])]
    got = get_all(app, [f"/v1/responses/{rid}" for rid in ids])
    assert [r.status_code for r in got] == [404, 200, 200]  # (400 kB each: three are past 1 MiB)
    assert "newest 1024 responses stored with store: true, up to 1 MiB of them" in got[0].json()["error"]["message"]
    assert got[2].json()["output"][0]["content"][0]["text"] == "x" * 400_000
    with pytest.raises(SystemExit):
        parse_args(["--responses-store-mib", "0"])
    assert "--responses-store-mib must be a positive integer, got 0" in capsys.readouterr().err


def test_the_store_drops_no_running_response_for_its_bytes():
    """Past its bytes the store drops the oldest responses no longer being written; one still running stays (its run
    goes on, and GET and cancel still find it), even where such responses alone are past the bound; the one just
    written stays too. Each is counted again as it ends, its event log with it."""
    from tpgraph.server.errors import ApiError
    from tpgraph.server.response_store import EventLog, StoredResponse

    def stored(text: str, running: bool = False) -> StoredResponse:
        kept = StoredResponse({"status": "completed", "output": [text]}, [{"role": "user", "content": "x"}])
        if running:
            kept.live = lambda: kept.response
        return kept

    store = ResponseStore(capacity=10, max_bytes=10_000)
    run0, run1 = stored("r" * 3000, running=True), stored("r" * 3000, running=True)
    for rid, kept in [("done0", stored("d" * 3000)), ("run0", run0), ("done1", stored("d" * 3000)), ("run1", run1)]:
        store.put(rid, kept)
    assert list(store._stored) == ["run0", "done1", "run1"] and store.bytes <= 10_000
    store.put("big", stored("b" * 20_000))  # (alone past the bound: every other response done goes, the running stay)
    assert list(store._stored) == ["run0", "run1", "big"] and store.bytes > 10_000
    with pytest.raises(ApiError) as dropped:
        store.get("done1")
    assert dropped.value.status == 404 and "up to 10000 bytes of them" in dropped.value.message
    run0.log, run0.live = EventLog([{"delta": "e" * 5000}]), None  # (it ends, its events grown past what was put)
    store.ended("run0", run0)
    assert list(store._stored) == ["run0", "run1"] and store.bytes == run0.size() + run1.size() > 10_000
    run1.live = None
    store.ended("run1", run1)
    assert list(store._stored) == ["run1"] and store.bytes == run1.size() <= 10_000
    store.ended("run0", run0)  # (no longer stored: nothing)
    assert list(store._stored) == ["run1"]
    store.delete("run1")
    assert (len(store), store.bytes) == (0, 0)


def test_the_store_full_by_count_drops_a_finished_response_before_a_running_one():
    """Full by count, the store drops its oldest response no longer being written; a running background response goes
    (cancelled) only where every other is running too."""
    from tpgraph.server.response_store import StoredResponse

    def stored(running: bool = False) -> StoredResponse:
        kept = StoredResponse({"status": "completed", "output": []}, [])
        if running:
            kept.live = lambda: kept.response
        return kept

    store = ResponseStore(capacity=2)
    for rid, kept in [("run0", stored(running=True)), ("done0", stored()), ("done1", stored())]:
        store.put(rid, kept)
    assert list(store._stored) == ["run0", "done1"]
    store.put("run1", stored(running=True))
    assert list(store._stored) == ["run0", "run1"]
    store.put("run2", stored(running=True))  # (all running: the oldest goes)
    assert list(store._stored) == ["run1", "run2"]


def test_a_background_streams_event_log_counts_once_it_ends():
    """A background response is put queued, a few hundred bytes; its output and event log grow as it runs, and were
    never counted: it is measured again as it ends, and older responses go for it."""
    store = ResponseStore(max_bytes=1_000_000)
    app = make_app(ScriptedClient(["x" * 150_000]), store=store)
    httpx = httpx_module()

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            first = (await http.post("/v1/responses", json={"input": "x"})).json()["id"]
            streamed = await http.post("/v1/responses", json={"input": "x", "background": True, "stream": True})
            background = typed_events(streamed.text)[-1]["response"]["id"]
            await asyncio.wait([store.get(background).task], timeout=5)  # (its done callbacks, the store's first)
            return [first, background, (await http.get(f"/v1/responses/{first}")).status_code]

    first, background, status = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert status == 404 and list(store._stored) == [background]
    assert store.bytes == store.get(background).size() > 4 * 150_000  # (its log holds its 150 kB text many times over)


def test_a_whole_response_whose_client_left_is_not_stored_as_completed():
    from tpgtest.server_stubs import leave_mid_request

    client, store = EndlessClient(), ResponseStore()
    body = json.dumps({"model": "m", "input": "x"}).encode()
    took, _ = leave_mid_request(make_app(client, store=store), client, "/v1/responses", body, [])
    assert took < 3 and len(client.aborted) == 1
    # (Api.run stopped short when its client went away: what it wrote is no completed response to continue)
    assert [s.response["status"] for s in store._stored.values()] == []


def test_a_whole_auto_call_cut_by_max_output_tokens_is_incomplete_as_streamed():
    pieces = ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "</tool_call>", "\n"]
    whole, events, _ = respond(pieces, {"input": "Weather?", "tools": [WEATHER], "max_output_tokens": 5},
                               finish="length", tools=ToolOptions(parser="hermes"))
    assert events[-1]["type"] == "response.incomplete"
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert without_ids(whole["output"]) == without_ids(events[-1]["response"]["output"])


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_call_that_broke_off_is_no_completed_function_call(finish):
    """A call the model began and did not end (an EOS, or max_output_tokens, mid-arguments) is no call to run: read
    whole it is the reply's text (as vLLM's parser reads it); streamed, its function_call item (sent as it came, not
    taken back) is done "incomplete", never "completed"."""
    pieces = ["Sure. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Os']
    whole, events, _ = respond(pieces, {"input": "Weather?", "tools": [WEATHER]}, finish=finish,
                               tools=ToolOptions(parser="hermes"))
    assert [item["type"] for item in whole["output"]] == ["message"]
    assert whole["output"][0]["content"][0]["text"] == "".join(pieces)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(item["type"], item["status"]) for item in done] == [("message", "completed"),
                                                                 ("function_call", "incomplete")]
    assert events[-1]["response"]["output"][-1]["status"] == "incomplete"


def test_a_reasoning_item_is_no_later_turns_reasoning():
    # (a response cut in its thoughts left a reasoning item alone; the next turn's reply is not its)
    items = [{"role": "user", "content": "2+2?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm"}]},
             {"role": "user", "content": "Just answer."},
             {"role": "assistant", "content": "4"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it"}]},
             {"type": "function_call_output", "call_id": "c0", "output": "x"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}]
    messages = chat_messages(items)
    assert [m.get("reasoning") for m in messages] == [None, None, None, None, None]


def test_a_background_response_stored_over_under_its_id_is_cancelled():
    # (the same X-Request-Id names both: the first, no longer stored, could be neither read nor cancelled)
    client = EndlessClient()
    store = ResponseStore()
    app = make_app(client, store=store)
    httpx = httpx_module()

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            headers = {"X-Request-Id": "same"}
            first = (await http.post("/v1/responses", json={"input": "x", "background": True},
                                     headers=headers)).json()
            await asyncio.sleep(0.05)
            task = store.get(first["id"]).task
            second = (await http.post("/v1/responses", json={"input": "x", "background": True},
                                      headers=headers)).json()
            await asyncio.wait([task], timeout=5)  # (cancelled: it ends, its request aborted)
            aborted = list(client.aborted)
            await http.post(f"/v1/responses/{second['id']}/cancel")
            for t in client.tasks:
                t.cancel()
            return [first["id"] == second["id"], task.done(), aborted]

    same, first_done, aborted = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert same and first_done and len(aborted) == 1


def test_background_streams_the_store_drops_before_they_begin_still_end():
    # (a store of 1 and four background streams at once: each put drops the one before, whose task may not have begun;
    # a task cancelled before its first step never runs its body, so its log never ended and its POST hung for good)
    store = ResponseStore(1)
    app = make_app(ScriptedClient(["a", "b"]), store=store)
    httpx = httpx_module()

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"input": "x", "background": True, "stream": True}
            return await asyncio.gather(*(http.post("/v1/responses", json=body) for _ in range(4)))

    replies = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert [r.status_code for r in replies] == [200] * 4
    # (the one put last, which the store keeps, completes; the POSTs are handled concurrently, so it need not be the
    # last of them: asserting that of replies[-1] failed about one run in 20)
    streams = {events[0]["response"]["id"]: events for events in (typed_events(r.text) for r in replies if r.text)}
    kept = [rid for rid in streams if rid in store._stored]
    assert len(store) == 1 and len(kept) == 1 and streams[kept[0]][-1]["type"] == "response.completed"


def test_input_items_lists_a_responses_own_input_a_page_at_a_time():
    app = make_app(ScriptedClient(["a"]))
    first, = post_all(app, [("/v1/responses", {"input": "earlier"})])
    items = [{"role": "user", "content": str(i)} for i in range(3)]
    second, = post_all(app, [("/v1/responses", {"input": items, "previous_response_id": first.json()["id"]})])
    rid = second.json()["id"]
    httpx = httpx_module()

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [(await http.get(f"/v1/responses/{rid}/input_items", params=q)).json()
                    for q in ({}, {"order": "asc", "limit": 2}, {"limit": 0})]

    newest_first, page, refused = asyncio.run(main())
    # (not the earlier response's)
    assert [item["content"][0]["text"] for item in newest_first["data"]] == ["2", "1", "0"]
    assert all(item["id"].startswith("msg_") for item in newest_first["data"])
    assert newest_first["has_more"] is False and newest_first["first_id"] == newest_first["data"][0]["id"]
    assert [item["content"][0]["text"] for item in page["data"]] == ["0", "1"] and page["has_more"] is True

    async def after() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return (await http.get(f"/v1/responses/{rid}/input_items",
                                   params={"order": "asc", "after": page["last_id"]})).json()

    assert [item["content"][0]["text"] for item in asyncio.run(after())["data"]] == ["2"]
    assert "limit must be between 1 and 100" in refused["error"]["message"]
    # the SDK reads them as its ResponseItem list
    whole, = post_all(app, [("/v1/responses", {"input": "x"})])

    async def sdk() -> list:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", http_client=http, max_retries=0)
        listed = [item async for item in client.responses.input_items.list(whole.json()["id"])]
        await http.aclose()
        return listed

    listed = asyncio.run(sdk())
    assert [(item.type, item.role, item.content[0].text) for item in listed] == [("message", "user", "x")]


@pytest.mark.parametrize(("parser", "pieces"), [
    ("hermes", ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
                "</tool_call>"]),
    ("pythonic", ["[get_weather(", "city='Oslo')]", " Done."]),  # (text after the call)
])
def test_a_whole_auto_replys_text_logprobs_are_its_texts_tokens_as_streamed(parser, pieces):
    # (a whole "auto" reply's calls are read once it ends, beside its text: the text's log-probabilities are still its
    # own tokens', not the calls')
    whole, events, _ = respond(pieces, {"input": "Weather?", "tools": [WEATHER],
                                        "include": ["message.output_text.logprobs"]},
                               tools=ToolOptions(parser=parser))
    texts = [item["content"][0] for item in events[-1]["response"]["output"] if item["type"] == "message"]
    assert [len(text["logprobs"]) for text in texts] == [1]
    assert [item["content"][0] for item in whole["output"] if item["type"] == "message"] == texts


@pytest.mark.parametrize(("pieces", "count"), [
    (["Four", "<", "/", "x", "</think>", "4"], 4),  # ("<" and "/" held back: they might begin the end tag)
    (["<think>", "Four", "", " it is.", "</think>", "4"], 3),  # (a token that writes no text yet; the tags no thought)
])
def test_reasoning_tokens_count_the_thoughts_tokens(pieces, count):
    whole, events, _ = respond(pieces, {"input": "2+2?"}, reasoning="deepseek_r1")
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == count
    assert events[-1]["response"]["usage"] == whole["usage"]


@pytest.mark.parametrize("pieces", [["[get_weather(city='Oslo')] Done."], ["[get_weather(", "city='Oslo')]", " Done."]])
def test_text_after_a_call_is_a_message_after_its_function_call(pieces):
    # (the output items keep the order the model wrote them in, whole or streamed: a whole reply's calls and text are
    # read at once, at its end)
    whole, events, _ = respond(pieces, {"input": "Weather?", "tools": [WEATHER]}, tools=ToolOptions(parser="pythonic"))
    assert [item["type"] for item in whole["output"]] == ["function_call", "message"]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def test_input_items_are_listed_as_the_sdks_items():
    # (as OpenAI lists them: each item typed, with its status, a message's text as content parts, whatever short form
    # the request gave it in)
    items = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"}]
    app = make_app(ScriptedClient(["a"]))
    first, = post_all(app, [("/v1/responses", {"input": items})])
    httpx = httpx_module()

    async def main() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return (await http.get(f"/v1/responses/{first.json()['id']}/input_items", params={"order": "asc"})).json()

    listed = asyncio.run(main())["data"]
    from openai.types.responses import ResponseItem

    for item in listed:
        sdk_checked(TypeAdapter(ResponseItem), item)
    assert [(item["type"], item.get("role")) for item in listed] == [
        ("message", "user"), ("message", "assistant"), ("function_call", None), ("function_call_output", None)]
    assert [part["text"] for item in listed[:2] for part in item["content"]] == ["Weather?", "Checking."]
    # (the conversation runs as before: the chat of the same messages)
    second, = post_all(app, [("/v1/responses", {"input": "And now?", "previous_response_id": first.json()["id"]})])
    assert second.status_code == 200, second.text


@pytest.mark.parametrize("tools", [{}, {"tools": [WEATHER]}])  # (a reply read as it comes, or whole)
def test_the_thoughts_end_tag_is_no_token_of_the_texts_logprobs(tools):
    whole, events, _ = respond(["Four", "</think>", "4"], {"input": "2+2?", "include": ["message.output_text.logprobs"],
                                                           **tools},
                               reasoning="deepseek_r1", tools=ToolOptions(parser="hermes"))
    texts = [item["content"][0] for item in events[-1]["response"]["output"] if item["type"] == "message"]
    assert [(text["text"], len(text["logprobs"])) for text in texts] == [("4", 1)]
    assert [item["content"][0] for item in whole["output"] if item["type"] == "message"] == texts


@pytest.mark.parametrize("tools", [{}, {"tools": [WEATHER]}])  # (a reply read as it comes, or whole)
def test_a_token_that_ends_the_thoughts_and_begins_the_answer_is_the_texts_token(tools):
    # (its text is both: its entry goes with the answer's text, whole or streamed, in a delta as the text's others)
    whole, events, _ = respond(["Four", " it is</think>4", "."], {"input": "2+2?", **tools,
                                                                 "include": ["message.output_text.logprobs"]},
                               reasoning="deepseek_r1", tools=ToolOptions(parser="hermes"))
    texts = [item["content"][0] for item in events[-1]["response"]["output"] if item["type"] == "message"]
    assert [(text["text"], len(text["logprobs"])) for text in texts] == [("4.", 2)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [entry for e in deltas for entry in e["logprobs"]] == texts[0]["logprobs"]
    assert [item["content"][0] for item in whole["output"] if item["type"] == "message"] == texts


def test_the_streamed_text_deltas_carry_every_logprob_of_the_text():
    # (the last token writes no text, as an EOS: its entry, which the text's logprobs end with, comes in a delta too)
    whole, events, _ = respond(["Hel", "lo", ""], {"input": "x", "include": ["message.output_text.logprobs"]})
    done = next(e for e in events if e["type"] == "response.output_text.done")
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == done["text"] == "Hello"
    assert [entry for e in deltas for entry in e["logprobs"]] == done["logprobs"]
    assert len(done["logprobs"]) == 3 and whole["output"][0]["content"][0]["logprobs"] == done["logprobs"]


class CountingClient(ScriptedClient):
    """A scripted engine whose i-th token has the log-probability -(i + 1) / 10, to tell the tokens' entries apart."""

    def submit(self, request_id, prompt, params, sink) -> None:
        counted = iter(range(1, 1 << 20))

        def numbered(update) -> None:
            if update.logprob is not None:
                update.logprob = -next(counted) / 10
            sink(update)

        super().submit(request_id, prompt, params, numbered)


def test_a_whole_replys_text_after_a_call_takes_its_own_tokens_where_the_call_writes_it_too():
    # (the call's arguments hold the text after it: its log-probabilities are still the text's own token's)
    request = {"model": "m", "input": "Weather?", "tools": [WEATHER], "include": ["message.output_text.logprobs"]}
    app = make_app(CountingClient(["[get_weather(", "city=' Done.')]", " Done."]), tools=ToolOptions(parser="pythonic"))
    whole, streamed = post_all(app, [("/v1/responses", request), ("/v1/responses", {**request, "stream": True})])
    texts = [item["content"][0] for item in typed_events(streamed.text)[-1]["response"]["output"]
             if item["type"] == "message"]
    assert [(text["text"], [entry["logprob"] for entry in text["logprobs"]]) for text in texts] == [(" Done.", [-0.3])]
    assert [item["content"][0] for item in whole.json()["output"] if item["type"] == "message"] == texts


def test_a_long_thought_costs_the_answers_logprob_record_no_work_per_token_that_grows():
    # (each thought token's update must not rewrite every token before it: a long reasoning reply stays linear)
    from tpgraph.server.responses import AnswerTokens

    answer = AnswerTokens()
    for _ in range(3000):
        answer.add("", [{"logprob": -0.1}], thought=True)
    answer.add("4", [{"logprob": -0.2}], thought=False)
    assert answer.tokens[0] == ("", [{"logprob": -0.1}])  # (kept as added: the thoughts' end is a mark, no rewrite)
    assert answer.entries_of(["4"], 1) == [[{"logprob": -0.2}]]


@pytest.mark.parametrize("delta", [lambda text: Delta(reasoning=text), lambda text: Delta(text),
                                   lambda text: Delta(calls=[{"index": 0, "function": {"arguments": text}}])],
                         ids=["reasoning", "text", "arguments"])
def test_a_long_replys_output_items_grow_with_no_work_per_token_that_grows(delta):
    # (each token's text must not copy the item's text so far: a long reply's items stay linear to fold)
    from tpgraph.server.responses import OutputItems

    items = OutputItems()
    items.add(Delta(calls=[{"index": 0, "id": "c0", "function": {"name": "f", "arguments": ""}}]), [])
    CountedText.before = 0
    for _ in range(2000):
        items.add(delta(CountedText("abcd")), [])
    items.finish(incomplete=False)
    text = items.items[-1]["arguments"] if items.items[-1]["type"] == "function_call" \
        else items.items[-1]["content"][0]["text"]
    assert text == "abcd" * 2000 and CountedText.before == 0


def test_a_stream_that_fails_mid_way_ends_with_response_failed():
    # (OpenAI's stream ends a failed response with response.failed, the response "failed" with its error, as the SDK's
    # stream helper reads it; the stored response is that one)
    store = ResponseStore()
    streamed, = post_all(make_app(ScriptedClient(["a", "b"], finish="error"), store=store),
                         [("/v1/responses", {"model": "m", "input": "x", "stream": True})])
    events = typed_events(streamed.text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["message"] == events[-2]["message"] == "the engine failed: b"
    # (the error event's code is OpenAI's, the failed response's: it was the chat API's error type,
    # "InternalServerError", beside "server_error" in the same stream)
    assert events[-2]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "a"  # (what it wrote before it failed)
    assert store.get(failed["id"]).current() == failed


def test_a_streamed_response_is_stored_before_its_last_event_is_sent():
    # (a client that reads response.completed may at once continue it by previous_response_id: the response must be
    # stored by then, not once the send of its last event has returned, which waits where the client reads slowly)
    store = ResponseStore()
    app = make_app(ScriptedClient(["a"]), store=store)
    body = json.dumps({"model": "m", "input": "x", "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "server": ("t", 80), "client": ("c", 1)}
    stored_as_sent = []
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # (the client stays)

    async def send(message: dict) -> None:
        if b"response.completed" in message.get("body", b""):
            stored_as_sent.append(len(store))

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    assert stored_as_sent == [1]


def test_a_response_that_ended_short_has_no_item_still_in_progress():
    # (a failed or cancelled response is over: the item it was writing is done "incomplete", as one cut by
    # max_output_tokens, not left "in_progress" for a client to wait on)
    streamed, = post_all(make_app(ScriptedClient(["a", "b"], finish="error")),
                         [("/v1/responses", {"model": "m", "input": "x", "stream": True})])
    failed = typed_events(streamed.text)[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize(("given", "named"), [("resp_given", "resp_given"), ("given", "resp_given")])
def test_a_body_request_id_names_the_response_prefixed_once(given, named):
    # (vLLM's response id is the request_id as given, "resp_..." by default: one given so is not prefixed again)
    app = make_app(ScriptedClient(["a"]))
    whole, = post_all(app, [("/v1/responses", {"input": "x", "request_id": given})])
    assert whole.json()["id"] == named


@pytest.mark.parametrize("status", ["incomplete", "in_progress"])
def test_a_last_reasoning_item_not_finished_is_continued(status):
    # (as vLLM's: a response cut in its thoughts goes on from them, an assistant message of those thoughts continued,
    # not dropped for a new turn)
    thoughts = {"type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": "Two and two"}]}
    from tpgraph.chat import ChatTemplate

    codec = builtin_codec()
    # (a template that writes an assistant's thoughts, as Qwen3's: the built-in one writes none)
    codec.chat_template = ChatTemplate("{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>"
                                  "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}[end]{% endfor %}"
                                  "{% if add_generation_prompt %}[assistant]{% endif %}")

    def prompt(path: str, body: dict) -> str:
        client = ScriptedClient(["a"])
        done, = post_all(server_app.create_app(client, codec, ServerMetrics(), "m", 128), [(path, body)])
        assert done.status_code == 200, done.text
        return client.prompts[0]

    continued = prompt("/v1/responses", {"input": [{"role": "user", "content": "2+2?"}, thoughts]})
    assert continued == prompt("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "", "reasoning": "Two and two"}],
        "add_generation_prompt": False, "continue_final_message": True})


@pytest.mark.parametrize(("pieces", "kinds"), [
    (["Hm", "</think>", "\n\n", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
      "</tool_call>"], ["reasoning", "function_call"]),
    (["Hm", "</think>", "\n", "\n", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
      "</tool_call>", "\n"], ["reasoning", "function_call"]),
    (["Hm", "</think>", "\n\n", "Hi"], ["reasoning", "message"]),  # (whitespace that begins a text is its own)
    (["Hm", "</think>", "\n\n"], ["reasoning", "message"]),  # (a reply of whitespace alone is still its message)
])
def test_whitespace_beside_a_call_is_no_message_whole_or_streamed(pieces, kinds):
    # (a reasoning model writes "\n\n" after its thoughts' end, before its call: no text of the answer, no message
    # item, whole (as vLLM's parsers strip the content beside calls) nor streamed)
    whole, events, _ = respond(pieces, {"input": "Weather?", "tools": [WEATHER]}, reasoning="deepseek_r1",
                               tools=ToolOptions(parser="hermes"))
    assert [item["type"] for item in whole["output"]] == kinds
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])
    texts = [item["content"][0]["text"] for item in whole["output"] if item["type"] == "message"]
    assert texts == [] if "function_call" in kinds else texts == ["".join(pieces[2:])]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == "".join(texts)


def test_metadata_at_openais_limits_is_taken_and_echoed():
    metadata = {f"{i:064d}": "v" * 512 for i in range(16)}
    whole, events, _ = respond(["a"], {"input": "x", "metadata": metadata})
    assert whole["metadata"] == events[-1]["response"]["metadata"] == metadata


def test_max_tool_calls_is_taken_and_echoed():
    # (OpenAI's limit on built-in tool calls: this server runs none, so any limit holds; vLLM takes and echoes it)
    whole, events, _ = respond(["a"], {"input": "x", "max_tool_calls": 2, "tools": [WEATHER]},
                               tools=ToolOptions(parser="hermes"))
    assert whole["max_tool_calls"] == events[-1]["response"]["max_tool_calls"] == 2


def test_a_background_response_that_fails_is_stored_failed_with_openais_error():
    store = ResponseStore()
    app = make_app(ScriptedClient(["a", "b"], finish="error"), store=store)
    httpx = httpx_module()

    async def main() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            created = (await http.post("/v1/responses", json={"input": "x", "background": True})).json()
            await store.get(created["id"]).task  # (its run, to its end)
            return (await http.get(f"/v1/responses/{created['id']}")).json()

    failed = asyncio.run(asyncio.wait_for(main(), timeout=10))
    sdk_checked(RESPONSE, failed)  # (its error's code one of OpenAI's)
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "the engine failed: b"}


class HeldClient(ScriptedClient):
    """An engine under load: it answers each request as ScriptedClient does (or refuses it, where `refusal` is set),
    but each update only once the test lets one more through (`let(n)`), as a long prefill ahead holds it."""

    def __init__(self, pieces: list[str], refusal: str | None = None) -> None:
        super().__init__(pieces)
        self.refusal, self.permits, self.tasks = refusal, asyncio.Queue(), []

    def check(self, prompt, params) -> None:  # (the engine client's own check, made before it submits)
        if len(prompt) > 100:
            raise RequestError(f"the prompt is too long: {len(prompt)} tokens")

    def let(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.put_nowait(None)

    def submit(self, request_id, prompt, params, sink) -> None:
        updates: list[StepUpdate] = []
        if self.refusal is not None:
            self.prompts.append(prompt)
            updates.append(StepUpdate(request_id, 0, None, self.refusal, REFUSED))
        else:
            super().submit(request_id, prompt, params, updates.append)

        async def deliver() -> None:
            for update in updates:
                await self.permits.get()
                sink(update)

        self.tasks.append(asyncio.get_running_loop().create_task(deliver()))


async def polled(http, rid: str, status: str) -> dict:
    """The response once GET finds it in `status` (5 s at most)."""
    for _ in range(500):
        got = (await http.get(f"/v1/responses/{rid}")).json()
        if got.get("status") == status:  # (an error's body where it is not stored yet)
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(got)


@pytest.mark.parametrize("stream", [False, True])
def test_a_background_response_is_queued_at_once_while_the_engine_has_not_answered(stream):
    # (as OpenAI's and vLLM's: the POST returns the queued response before the engine answers; it hung until the
    # engine's first update came, the prompt's whole prefill under load)
    client, store = HeldClient(["a", "b"]), ResponseStore()
    app = make_app(client, store=store)
    httpx = httpx_module()

    async def main() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body, rid = {"input": "x", "background": True, "stream": stream}, "resp_held"
            posting = asyncio.ensure_future(http.post("/v1/responses", json=body, headers={"X-Request-Id": rid}))
            # (a stream's POST answers as the response ends: this transport reads an answer whole)
            queued = None if stream else (await asyncio.wait_for(posting, timeout=5)).json()
            waiting = await polled(http, rid, "queued")
            client.let()  # (the engine answers its first token)
            running = await polled(http, rid, "in_progress")
            client.let()
            done = await polled(http, rid, "completed")
            events = typed_events((await posting).text) if stream else []
            return queued, waiting, running, done, events

    # (a POST still waiting on the engine: the old code's hang, a timeout here, not a hang of the suite)
    queued, waiting, running, done, events = asyncio.run(asyncio.wait_for(main(), timeout=10))
    if not stream:
        assert queued["status"] == "queued" and queued["output"] == [] and queued["background"] is True
    assert waiting["status"] == "queued" and waiting["output"] == []
    assert running["output"][0]["content"][0]["text"] == "a"
    assert done["output"][0]["content"][0]["text"] == "ab" and done["usage"]["output_tokens"] == 2
    if stream:
        assert events[-1]["type"] == "response.completed" and events[-1]["response"] == done


def test_a_background_response_the_engine_refuses_after_it_was_queued_ends_failed():
    # (a refusal only the engine can make, a grammar it cannot compile: the response was queued, so it ends "failed"
    # with OpenAI's invalid_prompt, read back by GET; checks made before it reaches the engine stay the POST's 400)
    client, store = HeldClient(["a"], refusal="the regex cannot be used: Unclosed '['"), ResponseStore()
    app = make_app(client, store=store)
    httpx = httpx_module()

    async def main() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            posting = asyncio.ensure_future(http.post("/v1/responses", json={"input": "x", "background": True}))
            created = (await asyncio.wait_for(posting, timeout=5)).json()
            client.let()
            await store.get(created["id"]).task
            failed = (await http.get(f"/v1/responses/{created['id']}")).json()
            too_long = await http.post("/v1/responses", json={"input": "x " * 500, "background": True})
            return created, failed, too_long

    created, failed, too_long = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert created["status"] == "queued"
    sdk_checked(RESPONSE, failed)
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "invalid_prompt", "message": "the regex cannot be used: Unclosed '['"}
    assert too_long.status_code == 400 and "too long" in too_long.json()["error"]["message"]
    assert len(client.prompts) == 1  # (the long prompt never reached the engine)


def test_a_background_response_to_an_engine_that_is_gone_is_a_503_not_queued():
    # (the POST answers before the engine takes the request: an engine already gone is said there, as the other
    # routes and vLLM's say it, not a response queued to fail)
    client, store = HeldClient(["a"]), ResponseStore()
    client.error = "the engine process exited"
    app = make_app(client, store=store)
    httpx = httpx_module()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.post("/v1/responses", json={"input": "x", "background": True})

    got = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert got.status_code == 503 and "the engine stopped: the engine process exited" in got.json()["error"]["message"]
    assert client.prompts == []


def test_a_background_stream_is_streamed_and_read_again_from_any_event():
    # (as OpenAI's and vLLM's: background with stream: true streams its events, and GET ?stream=true&starting_after=N
    # streams them again from the event after N, while the response runs on whatever its readers do)
    store = ResponseStore()
    app = make_app(ScriptedClient(["Hel", "lo"]), store=store)
    httpx = httpx_module()

    async def main() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            streamed = await http.post("/v1/responses", json={"input": "x", "background": True, "stream": True})
            events = typed_events(streamed.text)
            rid = events[0]["response"]["id"]
            again = await http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 3})
            whole = await http.get(f"/v1/responses/{rid}")
            plain, = [r.json() for r in [await http.post("/v1/responses", json={"input": "x"})]]
            refused = await http.get(f"/v1/responses/{plain['id']}", params={"stream": "true"})
            return events, typed_sse_events(again.text), whole.json(), refused

    events, again, whole, refused = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert events[0]["response"]["background"] is True and events[-1]["type"] == "response.completed"
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert again == events[4:]
    assert whole == events[-1]["response"] and whole["output"][0]["content"][0]["text"] == "Hello"
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]


@pytest.mark.parametrize("tools", [{}, {"tools": [WEATHER]}])  # (a reply read as it comes, or whole)
def test_a_reply_of_whitespace_alone_keeps_its_texts_logprobs(tools):
    whole, events, _ = respond(["\n", "\n"], {"input": "x", "include": ["message.output_text.logprobs"], **tools},
                               tools=ToolOptions(parser="hermes"))
    texts = [item["content"][0] for item in events[-1]["response"]["output"] if item["type"] == "message"]
    assert [(text["text"], len(text["logprobs"])) for text in texts] == [("\n\n", 2)]
    assert [item["content"][0] for item in whole["output"] if item["type"] == "message"] == texts


@pytest.mark.parametrize(("starting_after", "first"), [(None, 0), (-1, 0), (-5, 0), (2, 3), (99, None)])
def test_a_background_streams_log_is_read_from_the_event_after_starting_after(starting_after, first):
    from tpgraph.server.response_store import EventLog

    log = EventLog()
    for n in range(5):
        log.add({"sequence_number": n})
    log.end()

    async def read() -> list[int]:
        return [e["sequence_number"] async for e in log.read(starting_after)]

    assert asyncio.run(read()) == ([] if first is None else list(range(first, 5)))



def test_a_texts_part_begins_with_no_logprobs_streamed_or_read_again():
    # (content_part.added is the part as it begins, no text yet: it carried the entries of the text after it (the
    # item's list, grown by the first delta's before it was sent), and a background stream's replay all the text's)
    _, events, _ = respond(["Hel", "lo"], {"input": "x", "include": ["message.output_text.logprobs"]})
    added, = [e for e in events if e["type"] == "response.content_part.added"]
    assert added["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    assert [len(e["logprobs"]) for e in events if e["type"] == "response.output_text.delta"] == [1, 1]


def test_a_background_streams_part_is_read_again_as_it_began():
    store = ResponseStore()
    app = make_app(ScriptedClient(["Hel", "lo"]), store=store)
    httpx = httpx_module()

    async def main() -> list[dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            created = (await http.post("/v1/responses", json={"input": "x", "background": True, "stream": True,
                                                              "include": ["message.output_text.logprobs"]}))
            rid = typed_events(created.text)[0]["response"]["id"]
            await store.get(rid).task  # (its run, to its end)
            again = await http.get(f"/v1/responses/{rid}", params={"stream": "true"})
            return typed_sse_events(again.text)

    events = asyncio.run(asyncio.wait_for(main(), timeout=10))
    added, = [e for e in events if e["type"] == "response.content_part.added"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert added["part"]["logprobs"] == [] and [len(e["logprobs"]) for e in deltas] == [1, 1]


def test_reasoning_effort_reaches_the_template_as_a_chat_requests_does():
    """The Responses API runs as a chat request: its reasoning.effort must reach the chat template as the chat's
    reasoning_effort does, enable_thinking false for "none" (else true). It went in as chat_template_kwargs'
    reasoning_effort alone, so {"effort": "none"} left a thinking template (Qwen3's) thinking."""
    import dataclasses

    from tpgraph.chat import ChatTemplate
    from tpgraph.tokenizer import BOS

    codec = dataclasses.replace(builtin_codec(), chat_template=ChatTemplate(
        "{{ reasoning_effort | default('unset') }}|{{ enable_thinking | default('unset') }}|"
        "{% for m in messages %}{{ m.content }}{% endfor %}", {"bos_token": BOS}))
    client = ScriptedClient(["ok"])
    app = server_app.create_app(client, codec, ServerMetrics(), "m", 128)
    bodies = [{}, {"reasoning": {"effort": "low"}}, {"reasoning": {"effort": "none"}}]
    replies = post_all(app, [("/v1/responses", {"model": "m", "input": "x", **b}) for b in bodies])
    assert [r.status_code for r in replies] == [200, 200, 200]
    rendered = ["unset|unset|x", "low|True|x", "none|False|x"]
    assert client.prompts == [codec.encode_text(text, add_special_tokens=False) for text in rendered]


def test_a_cancelled_background_stream_ends_with_the_cancelled_response():
    """A background stream's readers (the POST that created it, GET ?stream=true) saw a cancelled response's events
    stop with no closing event, as if cut off; it ends, as a response whose client went away does (vLLM's: OpenAI's
    stream has no response.cancelled), with response.completed carrying the cancelled response."""
    client = EndlessClient()
    app = make_app(client, store=ResponseStore())
    httpx = httpx_module()

    async def main() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            # (the test transport hands the POST's reply over whole, once its stream ends: read after the cancel)
            rid = "resp_cut"
            posted = asyncio.ensure_future(http.post("/v1/responses", headers={"X-Request-Id": rid},
                                                     json={"input": "x", "background": True, "stream": True}))
            for _ in range(500):  # (until it has written a few tokens)
                got = await http.get(f"/v1/responses/{rid}")
                if got.status_code == 200 and got.json()["output"] and \
                        len(got.json()["output"][0]["content"][0]["text"]) >= 2:
                    break
                await asyncio.sleep(0.01)
            cancelled = (await http.post(f"/v1/responses/{rid}/cancel")).json()
            streamed = typed_events((await asyncio.wait_for(posted, 5)).text)
            again = typed_sse_events((await http.get(f"/v1/responses/{rid}", params={"stream": "true"})).text)
            for t in client.tasks:
                t.cancel()
            return cancelled, streamed, again

    cancelled, streamed, again = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert cancelled["status"] == "cancelled"
    for events in (streamed, again):
        assert events[-1]["type"] == "response.completed", events[-1]
        assert events[-1]["response"]["status"] == "cancelled" and events[-1]["response"] == cancelled
