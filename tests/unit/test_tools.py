"""Function calling: tools and tool_choice checked and planned, the model's reply read as tool calls (streamed and
whole), the parsers, and earlier calls passed to the chat template."""

import json

import pytest
from tpgtest.copies import CountedText
from tpgtest.tool_replies import TIME, WEATHER, read_reply

from tpgraph.chat import BUILTIN_TEMPLATE, ChatTemplate
from tpgraph.errors import RequestError
from tpgraph.server.protocol import ChatRequest
from tpgraph.server.reply import merge_calls
from tpgraph.server.tool_parsers import HermesParser, Llama3JsonParser, PythonicParser
from tpgraph.server.tools import ToolOptions, ToolPlan, required_schema, template_tools

AUTO = ToolOptions(parser="hermes")
PLAIN = ToolOptions()
NAMES = frozenset({"f", "g", "get_weather"})  # (the functions a request offers, for the parsers)


def plan(tool_choice=None, tools=(WEATHER, TIME), parallel=None, options=PLAIN) -> ToolPlan:
    return ToolPlan.of(list(tools), tool_choice, parallel, options)


def read(p: ToolPlan, pieces: list[str], finish: str = "stop") -> tuple[list, dict, str]:
    """A whole (non-streamed) reply's pieces read. (test_tool_streams.py reads streamed replies.)"""
    return read_reply(p, pieces, finish)


@pytest.mark.parametrize(("tools", "choice", "options", "needle"), [
    ([WEATHER], None, ToolOptions(), "--enable-auto-tool-choice and --tool-call-parser"),  # the default is "auto"
    ([WEATHER], "auto", ToolOptions(), "--enable-auto-tool-choice"),
    (None, "required", ToolOptions(), "tool_choice needs tools"),
    ([WEATHER], "sometimes", ToolOptions(), "is not one of"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, ToolOptions(), "not among the tools"),
    ([WEATHER], {"type": "function", "name": "get_weather"}, ToolOptions(), "is not understood"),
    ([{"type": "code_interpreter"}], "required", ToolOptions(), "function tools only"),
    ([{"type": "function", "function": {"description": "x"}}], "required", ToolOptions(), "needs a name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required", ToolOptions(),
     "JSON schema object"),
    ([WEATHER, WEATHER], "required", ToolOptions(), "two tools are named 'get_weather'"),
])
def test_tool_mistakes_get_a_reason(tools, choice, options, needle):
    with pytest.raises(RequestError, match=needle):
        ToolPlan.of(tools, choice, None, options)


def test_plans_and_what_the_template_sees():
    none = plan("none")
    assert none.mode == "none" and none.template_tools == template_tools([WEATHER, TIME]) and none.structured is None
    assert plan("none", options=ToolOptions(exclude_tools_when_none=True)).template_tools is None
    assert ToolPlan.of(None, None, None, ToolOptions()) == ToolPlan() == ToolPlan.of(None, "none", None, ToolOptions())
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert named.function == "get_weather" and json.loads(named.structured.spec) == WEATHER["function"]["parameters"]
    assert json.loads(plan({"type": "function", "function": {"name": "get_time"}}).structured.spec) == {
        "type": "object"}
    auto = plan(options=AUTO)
    assert auto.mode == "auto" and isinstance(auto.parser, HermesParser) and auto.structured is None


def test_the_template_sees_each_tool_as_vllm_dumps_it():
    """vLLM hands the chat template each tool as its pydantic model dumps it: "type" first, then the function's name,
    description and parameters (null where the request leaves them out), then other keys as written. A tool written
    in another order, or without a description, rendered another prompt than vLLM's."""
    tool = {"function": {"strict": True, "parameters": {"type": "object"}, "name": "f"}, "x": 1}
    seen = plan("none", tools=[tool, TIME]).template_tools
    f = {"name": "f", "description": None, "parameters": {"type": "object"}, "strict": True}
    assert seen == [{"type": "function", "function": f, "x": 1},
                    {"type": "function", "function": {"name": "get_time", "description": None, "parameters": None}}]
    assert [list(t) for t in seen] == [["type", "function", "x"], ["type", "function"]]
    assert list(seen[0]["function"]) == ["name", "description", "parameters", "strict"]
    assert plan(options=AUTO, tools=[tool]).template_tools == seen[:1]  # (every choice's)
    assert tool == {"function": {"strict": True, "parameters": {"type": "object"}, "name": "f"}, "x": 1}  # (untouched)
    rendered = ChatTemplate(BUILTIN_TEMPLATE, {"bos_token": "<s>"}).render([], tools=seen[1:])
    dumped = '[{"type": "function", "function": {"name": "get_time", "description": null, "parameters": null}}]'
    assert dumped in rendered


def test_an_empty_tools_list_is_read_as_vllm_reads_it():
    """vLLM (as OpenAI) answers "required" with tools [] as "none", the tools dropped: it was a 400. Without a
    tool_choice, or with "none" or "auto" (where the server serves "auto"), tools [] is a plain reply whose chat
    template still gets tools [] (Llama 3.1's then writes its tool preamble), where it got none."""
    assert ToolPlan.of([], "required", None, PLAIN) == ToolPlan()
    for choice, options in ((None, PLAIN), ("none", PLAIN), ("auto", AUTO)):
        assert ToolPlan.of([], choice, None, options) == ToolPlan(template_tools=[]), choice
    assert ToolPlan.of([], "none", None, ToolOptions(exclude_tools_when_none=True)) == ToolPlan()
    with pytest.raises(RequestError, match="--enable-auto-tool-choice"):  # (vLLM's "auto" needs its parser still)
        ToolPlan.of([], "auto", None, PLAIN)
    with pytest.raises(RequestError, match="not among the tools"):
        ToolPlan.of([], {"type": "function", "function": {"name": "f"}}, None, PLAIN)


def test_required_schema_is_an_array_of_named_calls_with_defs_lifted():
    ref = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": {"type": "array"}}}}}
    schema = required_schema([WEATHER["function"], TIME["function"], ref["function"]], one_call=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"], ["locate"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == {"Point": {"type": "array"}}
    assert "$defs" not in schema["items"]["anyOf"][2]["properties"]["parameters"]
    assert "$defs" in ref["function"]["parameters"]  # (the request's own tool is left as it was)
    assert required_schema([TIME["function"]], one_call=True)["maxItems"] == 1
    clash = {"name": "other", "parameters": {"$defs": {"Point": {"type": "object"}}}}
    with pytest.raises(RequestError, match="define \\$defs.Point differently"):
        required_schema([ref["function"], clash], one_call=False)
    for defs in (5, [], "Point"):  # (no mapping: a 500 once)
        with pytest.raises(RequestError, match="parameters.\\$defs must be an object"):
            required_schema([{"name": "f", "parameters": {"$defs": defs}}], one_call=False)


def test_a_named_call_streams_its_arguments_as_generated():
    deltas, message, reason = read(plan({"type": "function", "function": {"name": "get_weather"}}),
                                   ['{"ci', 'ty":"Pa', 'ris"}'])
    first = deltas[0].calls[0]
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert [d.calls[0] for d in deltas[1:3]] == [{"index": 0, "function": {"arguments": p}} for p in ('ty":"Pa',
                                                                                                       'ris"}')]
    assert all(not d.content for d in deltas)
    assert message == {"role": "assistant", "content": "", "tool_calls": [  # (vLLM's content "" beside the call)
        {"id": first["id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
    assert reason == "stop"  # (OpenAI's for a named call)


def test_a_whole_required_reply_is_read_as_calls_once_whole():
    text = ('[{"name":"get_weather","parameters":{"city":"a}\\"{["}},'
            '{"name":"get_time","parameters":{}}]')
    deltas, message, reason = read(plan("required"), list(text))  # a character at a time
    sent = [(i, c) for i, d in enumerate(deltas) for c in d.calls]
    assert [i for i, _ in sent] == [len(text)] * 2  # (with the finish: test_tool_streams.py reads streamed replies)
    assert [json.loads(c["function"]["arguments"]) for _, c in sent] == [{"city": 'a}"{['}, {}]
    assert [c["index"] for _, c in sent] == [0, 1] and reason == "tool_calls" and message["content"] == ""
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]


def test_a_cut_reply_comes_back_as_text():
    cut = '[{"name":"get_time","parameters":{}},{"name":"get_wea'
    _, message, reason = read(plan("required"), [cut], finish="length")
    assert reason == "length" and message["content"] == '{"name":"get_wea'
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    _, message, reason = read(plan("required"), ['[{"name":"get_ti'], finish="length")
    assert message == {"role": "assistant", "content": '[{"name":"get_ti'} and reason == "length"


def test_parallel_tool_calls_false_keeps_one_call():
    two = '[{"name":"get_time","parameters":{}},{"name":"get_time","parameters":{}}]'
    _, message, _ = read(plan("required", parallel=False), [two])
    assert len(message["tool_calls"]) == 1
    hermes = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    _, message, _ = read(plan(parallel=False, options=AUTO), [hermes])
    assert len(message["tool_calls"]) == 1
    _, message, _ = read(plan(options=AUTO), [hermes])
    assert len(message["tool_calls"]) == 2


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"x": 1}}', None,
     [("f", {}), ("g", {"x": 1})]),
    (' \n{"name": "f", "parameters": {"é": "ü"}}', None, [("f", {"é": "ü"})]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "f"}', '{"name": "f"}', []),  # (no arguments: not a call)
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),
    ('{"a": 1} and more', '{"a": 1} and more', []),
    ('{"name": "f", "parameters": {}}; and more', None, [("f", {})]),  # (vLLM's: no content beside the calls)
    # (a later call cut, or no call: vLLM's parser fails on the reply, as the server reads it whole, reply.py)
    ('{"name": "f", "parameters": {}}; {"name": "g", "par', '{"name": "f", "parameters": {}}; {"name": "g", "par', []),
    ('{"name": "f", "parameters": {}}; {"answer": 42}', '{"name": "f", "parameters": {}}; {"answer": 42}', []),
    ('{"name": "Alice", "parameters": {}}', '{"name": "Alice", "parameters": {}}', []),  # (no such function)
    ('{"name": "f", "parameters": {"n": NaN}}', '{"name": "f", "parameters": {"n": NaN}}', []),  # (not JSON's)
    ('{"name": "f", "parameters": {"n": 1e999}}', '{"name": "f", "parameters": {"n": 1e999}}', []),
    ('{"name": "f", "parameters": {"n": ' + "9" * 5000 + "}}", '{"name": "f", "parameters": {"n": ' + "9" * 5000 + "}}",
     []),  # (past Python's 4300 digits)
    ('{"name": "f", "parameters": ' + "[" * 100_000, '{"name": "f", "parameters": ' + "[" * 100_000, []),
])
def test_llama3_json_parser(text, content, calls):
    got_content, got = Llama3JsonParser().parse(text, NAMES)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    if calls:
        assert "\\u" not in "".join(c.arguments for c in got)  # (kept as written: ensure_ascii off)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Let me look.<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>', "Let me look.", [("f", {"q": 1})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}', None,
     [("f", {}), ("g", {})]),  # (a last block left open is read too)
    ("No tools needed.", "No tools needed.", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and then', None, [("f", {})]),  # (vLLM's: dropped)
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"',
     '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"', []),  # (cut: as the server's)
    ('<tool_call>{"name": "f", "arguments": {}} oops</tool_call>', '<tool_call>{"name": "f", "arguments": {}} oops'
     "</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"q\\": 2}"}</tool_call>', None, [("f", {"q": 2})]),  # (a string)
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}'
     "</tool_call>", []),
    ("<tool_call>" + "[" * 100_000, "<tool_call>" + "[" * 100_000, []),
])
def test_hermes_parser(text, content, calls):
    got_content, got = HermesParser().parse(text, NAMES)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_auto_streams_content_then_sends_the_calls():
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    deltas, message, reason = read(plan(options=AUTO), [text[i:i + 3] for i in range(0, len(text), 3)])
    assert "".join(d.content for d in deltas) == "Checking."
    assert [c for d in deltas[:-1] for c in d.calls] == []  # (the calls come once the reply is whole)
    assert message["content"] == "Checking." and reason == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    # a reply without calls is all content, with the engine's finish reason
    deltas, message, reason = read(plan(options=AUTO), ["Plain ", "<tool", " talk"], finish="length")
    assert "".join(d.content for d in deltas) == "Plain <tool talk" == message["content"] and reason == "length"
    assert "tool_calls" not in message


def test_merge_calls_folds_streamed_deltas():
    deltas = [{"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{"}},
              {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
              {"index": 1, "function": {"arguments": "}"}}]
    assert merge_calls(deltas) == [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                                   {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]


def test_merge_calls_folds_a_long_calls_deltas_without_copying_its_arguments_for_each():
    """A whole reply's named call (a delta a token) was folded by += on the call's arguments, copying all of them
    again for every delta (the square of their length); each call's pieces are now joined once."""
    pieces = ['{"text": "', *["word " for _ in range(2000)], '"}']
    deltas = [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]
    deltas += [{"index": 0, "function": {"arguments": CountedText(p)}} for p in pieces]
    CountedText.copied = 0
    assert merge_calls(deltas)[0]["function"]["arguments"] == "".join(pieces)
    assert CountedText.copied <= 2 * len("".join(pieces)), CountedText.copied


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "-3 C"},
]


def test_earlier_calls_reach_the_template_with_arguments_as_objects():
    messages = ChatRequest.model_validate({"model": "m", "messages": HISTORY}).checked_messages()
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert messages[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1", "name": "get_weather"}
    template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                            "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
                            "{% endfor %}{% endfor %}")
    assert template.render(messages, tools=[WEATHER, TIME]) == "[get_weather][get_time]get_weather(Oslo)"
    builtin = ChatTemplate(BUILTIN_TEMPLATE, {"bos_token": "<s>"}).render(messages, tools=[TIME])
    assert '<|tools|>\n[{"type": "function", "function": {"name": "get_time"}}]' in builtin
    assert '"arguments": {"city": "Oslo"}' in builtin and "<|tool|>\n-3 C" in builtin


@pytest.mark.parametrize(("arguments", "seen"), [
    (None, {}), ("", {}), ({}, {}), ([], {}), (0, {}), ('{"a": 1}', {"a": 1}), ({"a": 1}, {"a": 1}), ("null", {}),
])
def test_earlier_call_arguments_reach_the_template_as_vllm_reads_them(arguments, seen, caplog):
    """vLLM (renderers/chat_utils/parse_chat_message.py, _postprocess_messages) parses an earlier call's arguments
    from JSON text, keeps an object given as one, and reads none (null, "", an empty value, JSON null) as {},
    quietly."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    with caplog.at_level("WARNING", logger="tpgraph.chat"):
        (message,) = ChatRequest.model_validate(body).checked_messages()
    assert message["tool_calls"][0]["function"]["arguments"] == seen
    assert not caplog.records


@pytest.mark.parametrize("arguments", ["{oops", '{"a": 1', "[1, 2]", "5", '"text"', "true",
                                       [1], 5, True, 1.5])
def test_earlier_call_arguments_that_are_no_object_are_an_empty_one(arguments, caplog):
    """Newest vLLM (_postprocess_messages, "historical tool argument recovery") coerces an earlier call's arguments
    that do not parse, or that hold no object (a list, a number, a string), to {}, with a warning naming the call:
    the bad text lives in the conversation's history, so refusing it would fail every later turn. It was a 400 here,
    and JSON text of a list or a number reached the template as that value."""
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    body = {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    with caplog.at_level("WARNING", logger="tpgraph.chat"):
        (message,) = ChatRequest.model_validate(body).checked_messages()
    assert message["tool_calls"][0]["function"]["arguments"] == {}
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "'lookup'" in record.getMessage()
    assert "messages[0].tool_calls[0]" in record.getMessage()


@pytest.mark.parametrize(("call", "needle"), [
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}, "cannot parse"),
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"n": ' + "1" * 5000 + "}"}},
     "cannot parse"),
    ({"id": "c", "function": {"arguments": "{}"}}, "must be"),
    ("call", "must be"),
])
def test_a_bad_earlier_call_gets_a_reason(call, needle):
    """A call that is no {"function": {...}} object is refused (as vLLM refuses it); so is JSON text Python's parser
    cannot hold, nested past its stack or an integer past its digit limit (vLLM's json.loads raises RecursionError
    or ValueError there, which its coercion, of JSONDecodeError alone, does not catch)."""
    body = {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    with pytest.raises(RequestError, match=needle):
        ChatRequest.model_validate(body).checked_messages()


def test_tools_and_response_format_do_not_mix_and_hermes_keeps_special_tokens():
    body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "tools": [WEATHER], "tool_choice": "required",
                                       "response_format": {"type": "json_object"}})
    with pytest.raises(RequestError, match="cannot also take response_format"):
        body.sampling_params(8, None, tools=body.tool_plan(ToolOptions()))
    body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "tools": [WEATHER]})
    assert body.sampling_params(8, None, tools=body.tool_plan(AUTO)).skip_special_tokens is False
    assert body.sampling_params(8, None, tools=body.tool_plan(ToolOptions("llama3_json"))).skip_special_tokens
    required = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                           "tools": [WEATHER], "tool_choice": "required"})
    assert required.sampling_params(8, None, tools=required.tool_plan(ToolOptions())).structured.kind == "json_schema"


def test_required_calls_break_off_where_json_cannot_hold_them():
    """A value JSON cannot hold ends the call there, as a stream, which sent the call, ends it: its arguments as far
    as they went, the rest content, and no "tool_calls" finish (test_tool_streams.py reads streamed replies)."""
    for bad in ("1e999", "9" * 5000):
        text = '[{"name":"get_weather","parameters":{"n":' + bad + "}}]"
        _, message, reason = read(plan("required"), [text])
        assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"n": ']
        assert message["content"] == bad + "}}]" and reason == "stop"


def test_raw_control_characters_in_strings_are_re_encoded():
    """A model may write a raw tab inside a JSON string, which strict JSON forbids: the call is taken, and its
    arguments re-encoded as valid JSON."""
    _, message, _ = read(plan("required"), ['[{"name":"get_weather","parameters":{"city":"a\tb\x00"}}]'])
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "a\tb\x00"}
    _, calls = Llama3JsonParser().parse('{"name": "f", "parameters": {"q": "x\ty"}}', NAMES)
    assert json.loads(calls[0].arguments) == {"q": "x\ty"}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[get_weather(city="Oslo"), f()]', None, [("get_weather", {"city": "Oslo"}), ("f", {})]),
    ('<|python_start|>[g(x=[1, 2], y={"a": None}, z=True)]<|python_end|>', None,
     [("g", {"x": [1, 2], "y": {"a": None}, "z": True})]),
    ("Just text.", "Just text.", []),
    ("[f(1)]", "[f(1)]", []),  # (positional arguments: not a call)
    ("[f(x=open('p'))]", "[f(x=open('p'))]", []),  # (only literals: nothing is run)
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # (a set: no JSON form)
    ("[nope(x=1)]", "[nope(x=1)]", []),  # (not offered)
    ("[f(x=1", "[f(x=1", []),  # (cut)
    ("[" * 100_000, "[" * 100_000, []),
])
def test_pythonic_parser(text, content, calls):
    got_content, got = PythonicParser().parse(text, NAMES)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_pythonic_replies_are_read_as_calls_once_whole():
    _, message, reason = read(plan(options=ToolOptions(parser="pythonic")), ['[get_weather(', 'city="Rome")]'])
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert reason == "tool_calls" and message["content"] is None
