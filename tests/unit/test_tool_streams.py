"""Streamed tool calls: JSON re-encoded a character at a time as json.dumps writes the whole, call objects read as
they come, and each format's stream ("required", llama3_json, hermes) against the same reply read whole."""

import json
import random
from itertools import accumulate

import pytest
from tpgtest.tool_replies import TIME, WEATHER, read_reply

from tpgraph.server.json_stream import CallReader, Reencoder
from tpgraph.server.reply import ReplyReader
from tpgraph.server.tool_parsers import PARSERS
from tpgraph.server.tool_streams import RequiredStream
from tpgraph.server.tools import ToolOptions, ToolPlan

NAMES = frozenset({"get_weather", "get_time"})


def reencode(text: str, pieces: list[int] | None = None) -> tuple[str, Reencoder]:
    """Feed text a character at a time, taking the output after each piece (lengths in `pieces`)."""
    r, out, at = Reencoder(), [], 0
    for size in pieces or [1] * len(text):
        for ch in text[at:at + size]:
            if not r.feed(ch):
                break
        out.append(r.take())
        at += size
    r.end()
    out.append(r.take())
    return "".join(out), r


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 3 else []))
    if kind == "int":
        return rng.choice([0, -1, 7, 10 ** 30, -(2 ** 63)])
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e-7, 2.5e300, 3.14159, 100.0])
    if kind == "str":
        return "".join(rng.choice(['a', 'é', '"', '\\', '\n', '\t', '\x01', '/', '😀', ' ', '}', '{', ']'])
                       for _ in range(rng.randrange(6)))
    if kind in ("bool", "null"):
        return rng.choice([True, False]) if kind == "bool" else None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}{random_value(rng, 9) if rng.random() < 0.2 else ''}": random_value(rng, depth + 1)
            for i in range(rng.randrange(4))}


def written(rng: random.Random, value: object) -> str:
    """JSON as a model might write it: spacing of its own, escapes where json.dumps would not write them."""
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
    if rng.random() < 0.3:
        text = text.replace(",", " ,\n ").replace(":", " : ")  # (inside strings too: harmless)
    return text.replace("/", "\\/") if rng.random() < 0.3 else text


def test_reencoding_gives_what_json_dumps_gives_the_whole_in_any_chunking():
    rng = random.Random(0)
    for _ in range(400):
        value = {"v": random_value(rng)}
        text = written(rng, value)
        expected = json.dumps(json.loads(text), ensure_ascii=False)
        cuts = [rng.randrange(1, 6) for _ in range(len(text))]
        for pieces in (None, cuts):
            got, r = reencode(text, pieces)
            assert (got, r.done, r.failed) == (expected, True, False), text


@pytest.mark.parametrize("text", [
    '"\\ud83d\\ude00"',  # (a surrogate pair written as escapes is one character)
    '1E5', '-0.0', '1.50', '123456789012345678901234567890', '[ ]', '{ }', 'true', '[null, false]',
    '"\\u00e9\\/\\b\\f"', '"raw\ttab"',
])
def test_reencoding_single_values(text):
    assert reencode(text)[0] == json.dumps(json.loads(text, strict=False), ensure_ascii=False)


def test_a_lone_surrogate_stays_escaped_so_the_text_encodes():
    got, r = reencode('"\\ud83d x"')
    assert got == '"\\ud83d x"' and r.done
    got.encode()


@pytest.mark.parametrize("bad", ['{"a":NaN}', '{"a":1e999}', '{"a" 1}', '{"a":tru}', "[1,]", '{"a":1]', '{"a":01}',
                                 '"\\x"', '"\\u1_a4"', "{,}", '{"a":1,}', "[1 2]", "-Infinity", "{1: 2}",
                                 "[" * 513 + "]" * 513])  # (past MAX_DEPTH: Python's json.loads stops near 1000)
def test_text_that_is_no_json_fails(bad):
    r = reencode(bad)[1]
    assert r.failed and not r.done


def feed_call(text: str) -> CallReader:
    reader = CallReader(NAMES)
    for ch in text:
        if not reader.feed(ch):
            break
    return reader


def test_a_call_object_is_ready_once_named_and_its_arguments_begin():
    reader = CallReader(NAMES)
    for ch in '{"name": "get_weather", ':
        reader.feed(ch)
    assert not reader.ready and reader.take_arguments() == ""
    for ch in '"parameters": {"city": "Os':
        reader.feed(ch)
    assert reader.ready and reader.take_arguments() == '{"city": "Os'
    for ch in 'lo"}}':
        reader.feed(ch)
    assert reader.done and not reader.failed and reader.take_arguments() == 'lo"}'
    # arguments written before the name wait for it; other keys are skipped
    reader = feed_call('{"parameters": {"a": [1, 2]}, "id": {"x": "}"}, "name": "get_time"}')
    assert reader.done and reader.take_arguments() == '{"a": [1, 2]}'
    # arguments written as a JSON string of an object are sent whole
    assert feed_call('{"name": "get_time", "arguments": "{\\"a\\": 1}"}').take_arguments() == '{"a": 1}'


@pytest.mark.parametrize("text", [
    '{"name": "nope", "parameters": {}}',  # (not offered)
    '{"name": "get_time"}',  # (no arguments)
    '{"name": ["get_time"], "parameters": {}}',
    '{"name": "get_time", "parameters": [1]}',
    '{"name": "get_time", "arguments": "[1]"}',
    '["get_time"]',
])
def test_what_is_no_call_fails(text):
    assert feed_call(text).failed


def plan(choice=None, parser="hermes", parallel=None) -> ToolPlan:
    return ToolPlan.of([WEATHER, TIME], choice, parallel, ToolOptions(parser=parser))


def read(p: ToolPlan, text: str, sizes: list[int], stream: bool, finish: str = "stop") -> tuple[list, dict, str]:
    """The reply fed in pieces of these sizes."""
    assert sum(sizes) >= len(text), "the sizes must cover the whole reply"
    starts = accumulate(sizes, initial=0)
    return read_reply(p, [text[a:a + n] for a, n in zip(starts, sizes, strict=False)], finish, stream)


def read_alike(p: ToolPlan, text: str, *piecings: list[int], finish: str = "stop") -> tuple[dict, str]:
    """The reply read whole (its message and finish reason), once each piecing of it (a list of piece sizes) streamed
    is checked to read the same content, calls and finish reason (but where vLLM reads an "auto" reply whole
    otherwise than a stream can: whole_as_streamed)."""
    _, whole, reason = read(p, text, [len(text)], stream=False, finish=finish)
    for sizes in piecings:
        _, streamed, streamed_reason = read(p, text, sizes, stream=True, finish=finish)
        assert whole_as_streamed(p, text, streamed, streamed_reason, finish) == \
            (whole["content"], calls_of(whole), reason)
    return whole, reason


def streamed_alike(p: ToolPlan, text: str, *piecings: list[int], finish: str = "stop") -> tuple[dict, str]:
    """As read_alike, but the message and finish reason of the reply streamed (in the last piecing)."""
    read_alike(p, text, *piecings, finish=finish)
    _, streamed, reason = read(p, text, piecings[-1], stream=True, finish=finish)
    return streamed, reason


def whole_as_streamed(p: ToolPlan, text: str, streamed: dict, reason: str, finish: str) -> tuple:
    """(content, calls, finish reason) a whole reply gives where a stream of the same text gave `streamed`: the same,
    but for an "auto" reply as vLLM reads it whole: one that ended inside a call, or whose call broke off on bad
    JSON, is its text, no call, and calls read whole finish "tool_calls" whatever ended generation."""
    if p.mode != "auto":
        return streamed["content"], calls_of(streamed), reason
    probe = p.parser.stream(p.names, p.one_call)
    probe.read_whole(text)
    if probe.whole_is_text():
        return text, [], finish
    whole = calls_of(streamed) and not probe.broken
    return streamed["content"], calls_of(streamed), "tool_calls" if whole else reason


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


REPLIES = [  # (tool_choice, parser, reply)
    ("required", None, '[{"name": "get_weather", "parameters": {"city": "Os\\"lo}"}}, '
                       '{"name": "get_time", "parameters": {}}]'),
    ("required", None, '[{"name":"get_weather","parameters":{"n":[1.50,{"x":null}],"s":"\\u00e9"}}]'),
    (None, "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo\\t"}}; '
                          '{"parameters": {}, "name": "get_time"}'),
    (None, "llama3_json", ' {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'),
    (None, "llama3_json", "It is sunny; no tools needed."),
    (None, "llama3_json", '{"name": "Alice", "parameters": {}}'),
    (None, "hermes", 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'),
    (None, "hermes", 'a < b <tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call> then done.'),
    (None, "hermes", "<tool_call>not json</tool_call>"),
    (None, "hermes", "No tools <tool"),
]


@pytest.mark.parametrize(("choice", "parser", "reply"), REPLIES)
def test_a_streamed_reply_gives_what_the_whole_reply_gives(choice, parser, reply):
    rng = random.Random(1)
    _, whole, whole_reason = read(plan(choice, parser), reply, [len(reply)], stream=False)
    for sizes in ([1] * len(reply), [rng.randrange(1, 8) for _ in reply], [len(reply)]):
        deltas, message, reason = read(plan(choice, parser), reply, sizes, stream=True)
        assert (message["content"], calls_of(message), reason) == (whole["content"], calls_of(whole), whole_reason)


def sent_calls(deltas: list) -> list[tuple[int, dict]]:
    return [(i, c) for i, d in enumerate(deltas) for c in d.calls]


@pytest.mark.parametrize(("choice", "parser", "reply"), [REPLIES[i] for i in (0, 1, 2, 6)])  # (object arguments)
def test_calls_are_sent_as_they_are_written(choice, parser, reply):
    deltas, message, _ = read(plan(choice, parser), reply, [1] * len(reply), stream=True)
    sent = sent_calls(deltas)
    first = sent[0][1]
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function" and first["function"]["name"]
    name_at = reply.index(first["function"]["name"])
    assert sent[0][0] < reply.index("}") and sent[0][0] > name_at  # (sent before the first call's object closes)
    assert len([c for _, c in sent if c["index"] == 0]) > 3  # (its arguments in many deltas)
    assert all("id" not in c for _, c in sent if c is not first and c["index"] == 0)
    # each call's first delta comes once its name is read (and its arguments have begun: they are a beginning of
    # the call's whole arguments)
    whole = {c["function"]["name"]: c["function"]["arguments"] for c in message["tool_calls"]}
    for i, c in sent:
        if "id" in c:
            assert f'"{c["function"]["name"]}"' in reply[:i + 1]
            assert whole[c["function"]["name"]].startswith(c["function"]["arguments"]) and c["function"]["arguments"]


def test_a_stream_keeps_a_call_cut_by_max_tokens():
    cut = '{"name": "get_weather", "parameters": {"city": "Os'
    deltas, message, reason = read(plan(parser="llama3_json"), cut, [4] * 20, stream=True, finish="length")
    assert calls_of(message) == [("get_weather", '{"city": "Os')] and reason == "length"
    assert message["content"] is None
    # read whole, as vLLM's tool parser reads it, the cut call is no call: the reply is its text
    _, message, reason = read(plan(parser="llama3_json"), cut, [len(cut)], stream=False, finish="length")
    assert calls_of(message) == [] and message["content"] == cut and reason == "length"


@pytest.mark.parametrize(("parser", "reply"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Os'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}'),  # (its object not closed)
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"c'),
    ("hermes", 'Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Os'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_'),
    ("pythonic", '[get_weather(city="Oslo", days=3'),
    ("pythonic", '[get_time(), get_weather(city="Oslo")'),  # (the list not closed)
])
def test_a_whole_auto_reply_cut_in_a_call_is_its_text_with_no_call_as_vllms(parser, reply):
    """vLLM reads a whole "auto" reply with its tool parser's extract_tool_calls (hermes: json.loads of each
    <tool_call> block, the last one left open too; llama3_json: raw_decode from each "{"; pythonic: the whole list),
    which fails on a call max_tokens (or an EOS) cut, and then returns the model's text as content and no call, the
    engine's finish reason kept (serving.py's chat_completion_full_generator). Here the whole reply kept the call as
    far as it went, as a stream does: a stream still sends it as it comes (deltas cannot be taken back)."""
    for finish in ("length", "stop"):
        _, whole, reason = read(plan(parser=parser), reply, [len(reply)], stream=False, finish=finish)
        assert (whole["content"], calls_of(whole), reason) == (reply, [], finish)
        _, streamed, streamed_reason = read(plan(parser=parser), reply, [3] * len(reply), stream=True, finish=finish)
        assert calls_of(streamed) and (streamed_reason == finish or finish == "stop")  # (vLLM's stream: "length")


@pytest.mark.parametrize(("parser", "reply"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo" oops}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"n": tru}}'),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"n": 01}}'),
    ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo" oops}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
               '<tool_call>{"name": "get_weather", "arguments": {"city": [1 2]}}</tool_call>'),
    ("pythonic", '[get_weather(city="Oslo", days=3 4)]'),
    ("pythonic", '[get_time(), get_weather(city="Oslo", days=x)]'),
])
def test_a_whole_auto_reply_whose_call_breaks_on_bad_json_is_its_text_with_no_call_as_vllms(parser, reply):
    """vLLM's whole-reply parsers (extract_tool_calls: hermes json.loads of each block, llama3_json raw_decode from
    each "{", pythonic ast.parse of the list) fail on a call whose JSON (or Python) goes bad, though nothing cut it,
    and return the model's text as content and no call, the engine's finish reason kept. Here the whole reply kept
    the bad call as far as it went, with the rest as content, as a stream must (it sent the call before the JSON
    went bad)."""
    _, whole, reason = read(plan(parser=parser), reply, [len(reply)], stream=False)
    assert (whole["content"], calls_of(whole), reason) == (reply, [], "stop")
    _, streamed, streamed_reason = read(plan(parser=parser), reply, [3] * len(reply), stream=True)
    assert calls_of(streamed) and streamed_reason == "stop"  # (deltas cannot be taken back)


@pytest.mark.parametrize(("parser", "reply", "calls"), [
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', [("get_time", "{}")]),  # (its end tag cut)
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", '{"city": "Oslo"}')]),
])
def test_a_whole_auto_reply_whose_calls_are_whole_finishes_tool_calls_whatever_cut_it_as_vllms(parser, reply, calls):
    """vLLM's whole reply finishes "tool_calls" wherever its "auto" parser found calls (auto_tools_called), even where
    max_tokens ended the reply; a stream finishes so only where generation stopped by itself (finish_reason "stop").
    Here a whole reply kept "length"."""
    _, whole, reason = read(plan(parser=parser), reply, [len(reply)], stream=False, finish="length")
    assert (calls_of(whole), reason) == (calls, "tool_calls")
    _, streamed, streamed_reason = read(plan(parser=parser), reply, [3] * len(reply), stream=True, finish="length")
    assert (calls_of(streamed), streamed_reason) == (calls, "length")


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), [
    ("llama3_json", '{"name": "get_time", "parameters": {}}; and that is all', None, [("get_time", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}\n\nThe time is coming.', None,
     [("get_time", "{}")]),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
                    " Done.", None, [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("hermes", 'Let me see. <tool_call>{"name": "get_time", "arguments": {}}</tool_call> Then the weather: '
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> Done.', "Let me see. ",
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nI will wait for it.', None,
     [("get_time", "{}")]),
])
def test_text_after_the_calls_is_no_content_as_vllms(parser, reply, content, calls):
    """vLLM's llama3_json parser returns no content beside its calls (extract_tool_calls: content None; its stream
    parses `;`-separated objects and sends nothing past them), and its hermes parser only the text before the first
    <tool_call> (extract_tool_calls: model_output up to the first tag; its stream, _extract_content, likewise). Here
    the text after the calls came back as content, streamed and whole (a later block still is a call)."""
    for sizes in ([1] * len(reply), [5] * len(reply)):
        _, streamed, reason = read(plan(parser=parser), reply, sizes, stream=True)
        assert (streamed["content"], calls_of(streamed), reason) == (content, calls, "tool_calls")
    _, whole, reason = read(plan(parser=parser), reply, [len(reply)], stream=False)
    assert (whole["content"], calls_of(whole), reason) == (content, calls, "tool_calls")


TIME_CALL = '{"name": "get_time", "parameters": {}}'
TIME_BLOCK = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(("parser", "reply"), [
    ("llama3_json", TIME_CALL + '; {"answer": 42}'),  # (no name: vLLM's obj["name"] raises KeyError)
    ("llama3_json", TIME_CALL + '; {"name": "get_weather"}'),  # (no arguments)
    ("llama3_json", TIME_CALL + '; {"name": "get_weather", "parameters": oops}'),
    ("hermes", TIME_BLOCK + "<tool_call>not json</tool_call>"),
    ("hermes", TIME_BLOCK + '\n<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}} oops</tool_call>'),
])
def test_a_whole_auto_reply_with_a_bad_call_after_its_calls_is_its_text_as_vllms(parser, reply):
    """vLLM's whole-reply parsers read every call object (llama3_json: raw_decode from each "{" and obj["name"];
    hermes: json.loads of each block), and one after good calls that is no JSON, or no call, fails the reply: it is
    the model's text, no call. Here the calls before it were kept (and, since the text after calls is dropped, the
    bad one was lost). A stream, which sent the calls before it read the bad one, keeps them."""
    _, whole, reason = read(plan(parser=parser), reply, [len(reply)], stream=False)
    assert (whole["content"], calls_of(whole), reason) == (reply, [], "stop")
    _, streamed, reason = read(plan(parser=parser), reply, [2] * len(reply), stream=True)
    assert (streamed["content"], calls_of(streamed), reason) == (None, [("get_time", "{}")], "tool_calls")


@pytest.mark.parametrize(("parser", "reply"), [
    ("llama3_json", TIME_CALL + '; {"name": "get_wea'),
    ("llama3_json", TIME_CALL + "; {"),
    ("hermes", TIME_BLOCK + '<tool_call>{"name": "get_w'),
    ("hermes", TIME_BLOCK + "\n<tool_call>"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_'),
])
def test_a_stream_cut_in_a_call_not_yet_sent_after_its_calls_sends_none_of_it_as_content(parser, reply):
    """llama3_json and hermes drop what follows whole calls (CONTENT_AFTER_CALLS), as vLLM's streams send nothing
    past them. A stream cut (by max_tokens or an EOS) inside a later call object or block, before the call was sent,
    sent what it held of it as content at the end: `; {"name": "get_wea`, `<tool_call>`, `</tool_` beside the calls.
    (The whole reply is its text, as vLLM's parser fails on it.)"""
    for finish in ("stop", "length"):
        for sizes in ([1] * len(reply), [4] * len(reply)):
            _, streamed, _ = read(plan(parser=parser), reply, sizes, stream=True, finish=finish)
            assert (streamed["content"], calls_of(streamed)) == (None, [("get_time", "{}")]), (finish, sizes)


def test_a_call_after_the_calls_to_a_tool_not_offered_is_dropped_streamed_or_whole():
    """(A call to a function the request did not offer is no call here; after calls it is dropped, not the reply.)"""
    for parser, reply in (("llama3_json", TIME_CALL + '; {"name": "nope", "parameters": {}}'),
                          ("hermes", TIME_BLOCK + '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')):
        whole, reason = read_alike(plan(parser=parser), reply, [1] * len(reply))
        assert (whole["content"], calls_of(whole), reason) == (None, [("get_time", "{}")], "tool_calls")


def test_a_call_that_breaks_off_keeps_the_rest_as_content_in_a_stream():
    """A call sent that then breaks off keeps what it sent, and the rest is content (the whole reply is its text)."""
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo" oops}}</tool_call>'
    _, message, _ = read(plan(), reply, [3] * 40, stream=True)
    assert calls_of(message) == [("get_weather", '{"city": "Oslo"')] and message["content"] == "oops}}</tool_call>"


def test_one_call_when_parallel_tool_calls_is_false():
    reply = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    _, message, _ = read(plan(parallel=False), reply, [5] * 30, stream=True)
    assert calls_of(message) == [("get_time", "{}")] and message["content"] is None
    _, message, _ = read(plan(), reply, [5] * 30, stream=True)
    assert calls_of(message) == [("get_time", "{}")] * 2


PYTHONIC = [  # replies each read alike streamed or whole
    '[get_weather(city="Oslo", days=3), get_time()]',
    '<|python_start|>[get_weather(city=\'O,s)l"o\', n=[1, (2, 3)], x={"a": None}, t=True)]<|python_end|>',
    '[get_weather(city="""a"b""c""", q=\'\', r=r"\\\'"), get_time(), ]',  # (triple quotes, raw, trailing comma)
    '  [get_weather(s="\\u00e9\\n", a=1,)]  \n',
    "Sure: [get_time()]", "[nope()]", "[]", "[get_time(1)]", '[get_weather(city=float("nan"))]',
    '[get_weather(city="Os',  # (cut before any argument was whole: all text)
    "[get_time(a0=([False, -3],), a1=('\"a',),), get_time(a0='', b=\"\")]",  # (tuples' closing, empty strings)
]


@pytest.mark.parametrize("reply", PYTHONIC)
def test_pythonic_replies_read_alike_streamed_or_whole(reply):
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply), [3] * len(reply))


def test_pythonic_calls_are_sent_with_their_first_argument_and_each_argument_as_it_is_read():
    reply = '[get_weather(city="Oslo", days=3), get_time()]'
    deltas, message, reason = read(plan(parser="pythonic"), reply, [1] * len(reply), stream=True)
    sent = sent_calls(deltas)
    assert [i for i, _ in sent] == [reply.index(","), reply.index(")"), reply.rindex(")")]
    assert [c["function"] for _, c in sent] == [{"name": "get_weather", "arguments": '{"city": "Oslo"'},
                                               {"arguments": ', "days": 3}'}, {"name": "get_time", "arguments": "{}"}]
    assert [c["index"] for _, c in sent] == [0, 0, 1] and "id" in sent[2][1] and "id" not in sent[1][1]
    assert calls_of(message) == [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")]
    # a call cut after an argument was sent keeps it; the argument not read whole is content
    _, message, reason = read(plan(parser="pythonic"), '[get_weather(a=1, b="Os', [2] * 20, stream=True,
                              finish="length")
    assert calls_of(message) == [("get_weather", '{"a": 1')] and message["content"] == ' b="Os' and reason == "length"
    # parallel_tool_calls false: later calls are read and left out
    _, message, _ = read(plan(parser="pythonic", parallel=False), reply, [4] * 20, stream=True)
    assert calls_of(message) == [("get_weather", '{"city": "Oslo", "days": 3}')] and message["content"] is None



@pytest.mark.parametrize(("reply", "calls", "content"), [
    ('[get_weather(city="Oslo", days=open())]', [("get_weather", '{"city": "Oslo"}')], " days=open())]"),
    ('[get_weather(city="Oslo", city="Rome")]', [("get_weather", '{"city": "Oslo"}')], ' city="Rome")]'),
    ("[get_time(), get_weather(city='Oslo', n={1})]", [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
     " n={1})]"),
])
def test_a_pythonic_call_that_breaks_off_after_an_argument_is_no_tool_calls_finish(reply, calls, content):
    """An argument that is no literal (or a keyword given twice) after one was sent ends the call there: what was sent
    stays, closed, and the rest is content; the reply did not finish "tool_calls", which tells a client its calls are
    whole (this one lost an argument the model wrote), as a JSON call that breaks off does not. (Whole, the reply is
    its text, no call, as vLLM's ast.parse of the list fails on it.)"""
    streamed, reason = streamed_alike(plan(parser="pythonic"), reply, [1] * len(reply), [4] * len(reply))
    assert (calls_of(streamed), streamed["content"], reason) == (calls, content, "stop")


# what review found (helper-86): each case failed before its mend

DEEP = "[" * 3000 + "]" * 3000


@pytest.mark.parametrize(("choice", "parser", "reply"), [
    (None, "llama3_json", '{"name": ' + DEEP + ', "parameters": {}}'),
    (None, "hermes", '<tool_call>{"name": ' + DEEP + ', "arguments": {}}</tool_call>'),
    ("required", None, '[{"name": ' + DEEP + ', "parameters": {}}]'),
    (None, "llama3_json", '{"name": ["get_time"], "parameters": {}}'),  # (a name no string: json.loads raised)
    (None, "hermes", '<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>'),  # (unhashable: a 500 whole)
])
def test_a_name_that_is_no_string_is_content_streamed_or_whole(choice, parser, reply):
    for stream in (True, False):
        _, message, _ = read(plan(choice, parser), reply, [3] * (len(reply) // 3 + 1), stream=stream)
        assert message["content"] == reply and "tool_calls" not in message


@pytest.mark.parametrize("reply", [
    '{"name": "get_weather", "arguments": "Oslo"}',  # (a JSON string that is no object)
    '{"name": "get_weather", "arguments": 5}',
    '{"name": "get_weather", "parameters": [1]}',
])
def test_a_call_whose_arguments_are_no_object_is_never_sent(reply):
    deltas, message, _ = read(plan(parser="llama3_json"), reply, [3] * (len(reply) // 3 + 1), stream=True)
    assert not sent_calls(deltas) and message["content"] == reply


def test_a_lone_surrogate_escape_stays_an_escape_so_the_reply_encodes():
    reply = '<tool_call>{"name": "get_time", "arguments": {"a": "\\ud800"}}</tool_call>'
    for stream in (True, False):
        _, message, _ = read(plan(), reply, [len(reply)], stream=stream)
        assert calls_of(message) == [("get_time", '{"a": "\\ud800"}')]


@pytest.mark.parametrize(("parser", "reply", "parallel"), [
    ("llama3_json", '{"name": "get_time", "parameters": {}};', None),  # (a trailing separator is no content)
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone. \n', None),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.', False),  # (text after one)
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"a": "</tool_call>"}}</tool_call>', None),
])
def test_more_replies_read_alike_streamed_or_whole(parser, reply, parallel):
    whole, reason = read_alike(plan(parser=parser, parallel=parallel), reply, [2] * len(reply))
    assert calls_of(whole)


@pytest.mark.parametrize("reply", [
    '[{"name": "get_time", "parameters": {}}, ',  # (cut after the comma: no content)
    '[{"name": "get_time", "parameters": {}},\n {"na',  # (cut before the next call's name: the part call is text)
    '[{"name": "get_time", "parameters": {}} , {"name": "nope", "parameters": {}}]',  # (a tool not offered)
])
def test_a_required_reply_cut_between_calls_reads_alike_streamed_or_whole(reply):
    """max_tokens cuts a "required" array after a call: the whole reply's text begins at the part call, past the
    comma; a stream sent the comma and the whitespace around it as content too."""
    whole, reason = read_alike(plan("required"), reply, [1] * len(reply), [len(reply)], finish="length")
    assert calls_of(whole) == [("get_time", "{}")]


# what review found (helper-89, pythonic streams): each case failed before its mend

def test_a_literal_that_overflows_is_no_call_streamed_or_whole():
    """ast.literal_eval adds an int and a complex (`<int> + 1j`): an int past a float's range raises OverflowError,
    which neither the whole parser nor the stream catches (a 500, or a stream that breaks off)."""
    huge = "9" * 400 + "+1j"
    for reply, calls in ((f"[get_weather(a={huge})]", []),
                         (f"[get_weather(city='Oslo', a={huge})]", [("get_weather", '{"city": "Oslo"}')])):
        streamed, reason = streamed_alike(plan(parser="pythonic"), reply, [1] * len(reply))
        # (streamed, the call breaks off at the argument, closed after those sent; the rest is content; whole, the
        # reply is its text)
        assert calls_of(streamed) == calls and streamed["content"] == (reply if not calls else f" a={huge})]")


@pytest.mark.parametrize("reply", [
    "[get_time ()]",  # (Python allows whitespace between a name and its parenthesis)
    '[get_weather (city="Oslo")]',
    "[get_time\n()]",
    "\x0c[get_time()]",  # (str.strip() takes what the stream's whitespace does not: form feed, NBSP, U+3000...)
    "\u3000[get_time()]",
    "[get_time()]\xa0",
    '[get_weather(city="Oslo" # the capital, for now\n)]',  # (a comment: ast skips it, the scanner does not)
    "[get_weather(city='Oslo', # it's cold\n days=1)]",
])
def test_pythonic_replies_python_reads_as_calls_read_alike_streamed_or_whole(reply):
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply))
    assert calls_of(whole)


@pytest.mark.parametrize("reply", [
    '[get_weather(city="Oslo", days=1e400)]',  # (inf: no JSON)
    '[get_weather(city="Oslo", raw=b"x")]',
    '[get_weather(city="Oslo", city="Rome")]',  # (a keyword twice ends the calls)
    '[get_weather(city="Oslo", 3)]',
])
def test_a_pythonic_call_that_breaks_off_after_an_argument_still_sends_a_json_object(reply):
    """A call whose arguments are `{"city": "Oslo"` breaks every client's json.loads. Pythonic arguments go out a whole
    keyword at a time, so the object can always be closed where the call breaks off (the rest stays content); the
    reply keeps the engine's finish reason, not "tool_calls": the call lost what the model wrote after that."""
    _, message, reason = read(plan(parser="pythonic"), reply, [1] * len(reply), stream=True)
    assert reason == "stop"
    for _, arguments in calls_of(message):
        assert isinstance(json.loads(arguments), dict), arguments


def test_a_reply_that_can_no_longer_be_a_call_streams_as_content():
    """`[` and a word no tool's name begins with is held until a character that is no identifier's: the name grows a
    character at a time (`self.name += ch`, quadratic: 200k characters 0.6 s, 400k 2.2 s) and nothing is sent."""
    reader = ReplyReader(plan(parser="pythonic"), stream=True)
    sent = "".join(reader.feed(ch).content for ch in "[" + "a" * 200)
    assert sent.startswith("[a")


def test_parsing_a_pythonic_reply_prints_no_warnings():
    """ast.parse warns about what the model wrote (`"\\d"`: an invalid escape; `1if`), to the server's stderr."""
    import warnings

    for reply in ('[get_weather(pattern="\\d+")]', "[get_weather(a=1if 1 else 2)]"):
        for stream in (False, True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                read(plan(parser="pythonic"), reply, [len(reply)], stream=stream)
            assert not caught, [str(w.message) for w in caught]


def test_streamed_content_is_held_only_where_a_call_may_begin():
    """Content goes out as it comes, but for what may begin a call: hermes' tag's beginning, llama3_json's opening
    brace or tag, pythonic's bracket or tag."""
    cases = [("hermes", ["Hello <tool", "box>"], ["Hello ", "<toolbox>"]),
             ("llama3_json", ["  {", '"a": 1} no'], ["", '  {"a": 1} no']),
             ("llama3_json", ["<|pyth", "on_tag|>x"], ["", "<|python_tag|>x"]),
             ("pythonic", ["Sure: [1]"], ["Sure: [1]"]),
             ("pythonic", ["<|python", "_start|>[get_time(", "1)]"], ["", "", "<|python_start|>[get_time(1)]"])]
    for parser, pieces, sent in cases:
        reader = ReplyReader(plan(parser=parser), stream=True)
        got = [reader.feed(piece).content for piece in pieces]
        got[-1] += reader.finish("stop")[0].content
        assert got == sent, (parser, got)


# what review found (helper, differential streams): each case failed before its mend

@pytest.mark.parametrize("reply", [
    '\x0c{"name": "get_time", "parameters": {}}',
    '\xa0<|python_tag|>\u3000{"name": "get_time", "parameters": {}}',
    '{"name": "get_time", "parameters": {}};\u3000\n',
    '{"name": "get_time", "parameters": {}}\xa0 \x85',
])
def test_llama3_json_whitespace_python_strips_reads_alike_streamed_or_whole(reply):
    """The whole reply is str.strip()ped (then the tag str.lstrip()ped): form feed, NBSP, U+3000... around the calls
    are no content, but the stream took only JSON's whitespace there, so it sent the reply as text (leading) or the
    trailing space as content."""
    p = plan(parser="llama3_json")
    whole, reason = read_alike(p, reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) == [("get_time", "{}")] and whole["content"] is None


@pytest.mark.parametrize("gaps", [("\xa0", ""), ("\u3000", "\x0c"), ("\n\x85 ", " \xa0\n")])
def test_hermes_blank_gaps_of_any_whitespace_are_no_content_streamed_or_whole(gaps):
    """A whole reply drops a stretch between or after blocks that str.strip() empties (NBSP, U+3000, form feed...);
    the stream held only JSON's whitespace as blank, so it sent such a gap as content."""
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    reply = block + gaps[0] + block + gaps[1]
    whole, reason = read_alike(plan(), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) == [("get_time", "{}")] * 2 and whole["content"] is None


@pytest.mark.parametrize("reply", [
    "[ # the weather first\n get_weather(city='Oslo'),  # then the time\n get_time()  # done\n]",
    "[get_time # (no arguments)\n()]",
    '[get_time(), # ]) "\r get_time()]',  # (a lone \r ends a comment too)
    "[get_time()  # first\n, get_weather(city='Oslo')]",
])
def test_pythonic_comments_between_calls_read_alike_streamed_or_whole(reply):
    """ast skips a "#" comment between the list's calls (or after a name); the stream took it only inside a call's
    arguments, so it sent the reply, or what followed the first call, as text."""
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) and whole["content"] is None


@pytest.mark.parametrize("reply", ['[get_weather(city="Oslo" # c\r)]', '[get_weather(city="Oslo", # c\r days=1)]'])
def test_pythonic_a_comment_in_the_arguments_ends_at_a_lone_carriage_return(reply):
    """Python ends a comment at "\\r" as at "\\n" (ast reads these as calls); the stream's scanner read on to a "\\n",
    taking the rest of the call as comment: the reply was text, or the call broke off after its first argument."""
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply))
    assert calls_of(whole) and whole["content"] is None


# what review found (helper, truncated and duplicated calls): each case failed before its mend

@pytest.mark.parametrize(("choice", "parser", "reply"), [
    (None, "llama3_json", '{"name": "get_weather", "parameters": {"city": "Os'),  # (an EOS mid-call)
    (None, "hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Os'),
    (None, "hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo" oops}}</tool_call>'),  # (bad)
    ("required", None, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"c'),
    (None, "pythonic", '[get_weather(city="Oslo", days=3'),
])
def test_a_streamed_call_that_broke_off_never_finishes_as_tool_calls(choice, parser, reply):
    """A call sent whose arguments never ended (the model stopped mid-call, or wrote bad JSON) was reported with
    finish_reason "tool_calls", which tells a client its calls are whole and may be run: `{"city": "Os` broke its
    json.loads. The sent deltas stay (they cannot be taken back); the finish reason is the engine's."""
    for finish in ("stop", "length"):
        _, message, reason = read(plan(choice, parser), reply, [1] * len(reply), stream=True, finish=finish)
        assert reason == finish and message["tool_calls"]
        with pytest.raises(json.JSONDecodeError):
            json.loads(message["tool_calls"][-1]["function"]["arguments"])  # (left as written: nothing made up)


@pytest.mark.parametrize(("parser", "reply"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}'),  # (cut after the arguments)
    ("llama3_json", '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}" oops'),
])
def test_a_streamed_call_whose_arguments_are_whole_still_finishes_as_tool_calls(parser, reply):
    _, message, reason = read(plan(parser=parser), reply, [1] * len(reply), stream=True)
    assert reason == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] == "Oslo"


@pytest.mark.parametrize(("choice", "reply", "finish", "arguments", "content"), [
    ("required", '[{"name": "get_weather", "parameters": {"n": 1e999}}]', "stop", '{"n": ', "1e999}}]"),
    (None, '{"name": "get_weather", "parameters": {"n": tru}}', "stop", '{"n": ', "tru}}"),
    (None, '{"name": "get_weather", "parameters": {"n": 1, "m": 01}}', "stop", '{"n": 1, "m": ', "01}}"),
    (None, '{"name": "get_weather", "parameters": {"s": "ab\\x"}}', "stop", '{"s": "ab', '\\x"}}'),
    (None, '{"name": "get_weather", "parameters": {"s": "ab\\u12G4"}}', "stop", '{"s": "ab', '\\u12G4"}}'),
    (None, '{"name": "get_weather", "parameters": {"s": "\\uD83D\\x"}}', "stop", '{"s": "', '\\uD83D\\x"}}'),
    (None, '{"name": "get_weather", "parameters": {"n": 12', "length", '{"n": ', "12"),  # (cut)
    (None, '{"name": "get_weather", "parameters": {"s": "ab\\u00', "length", '{"s": "ab', "\\u00"),
    (None, '{"name": "get_weather", "parameters": {"s": "\\uD83D', "length", '{"s": "', "\\uD83D"),
    (None, '{"name": "get_weather", "parameters": {"s": "\\ud83d\\u', "length", '{"s": "', "\\ud83d\\u"),
])
def test_a_streamed_call_that_breaks_off_loses_none_of_the_text(choice, reply, finish, arguments, content):
    """Where a call sent breaks off, the text from there is content; what the reader held back of its arguments (a
    number or literal until it ends, an escape, a high surrogate until its low half) was dropped: "1e999}}]" came
    back as "}}]", a call cut at `"n": 12` lost the 12."""
    for sizes in ([1] * len(reply), [len(reply)]):
        _, message, reason = read(plan(choice, "llama3_json"), reply, sizes, stream=True, finish=finish)
        assert (calls_of(message), message["content"], reason) == ([("get_weather", arguments)], content, finish)


CUT_REPLIES = [  # (tool_choice, parser, reply): cut at every character, each reads alike streamed or whole
    ("required", None, '[{"name": "get_weather", "parameters": {"s": "\\u00e9\\ud83d\\ude00", "n": [1e5, -0, 1.0, '
                       '{"a": {}}]}}, {"name": "get_time", "parameters": {}}]'),
    (None, "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Os\\"lo", "n": 1E5}}; '
                          '{"arguments": {}, "name": "get_time"}'),
    (None, "hermes", 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"s": "\\uD83D\\uDE00", '
                     '"x": [[], {}]}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> '
                     "Done."),
    (None, "pythonic", '[get_weather(city="Oslo", n=[1e5, -0.0, {"a": None}]), get_time()]'),
]


@pytest.mark.parametrize(("choice", "parser", "reply"), CUT_REPLIES)
def test_a_reply_cut_anywhere_reads_alike_streamed_or_whole(choice, parser, reply):
    """max_tokens (or an EOS) may cut a reply at any character. Where a call was cut after a stream sent it, the
    stream keeps it (deltas cannot be taken back) and the rest as content; the whole reply reads as the stream does
    but where vLLM's reads it otherwise ("auto": a reply cut in a call is its text, whole calls finish "tool_calls";
    whole_as_streamed). A stream read a cut reply otherwise than these, a character at a time or in pieces."""
    rng = random.Random(2)
    p = plan(choice, parser)
    for cut in range(1, len(reply) + 1):
        text = reply[:cut]
        for finish in ("length", "stop"):
            _, whole, reason = read(p, text, [cut], stream=False, finish=finish)
            for sizes in ([1] * cut, [rng.randrange(1, 6) for _ in range(cut)]):
                _, streamed, streamed_reason = read(p, text, sizes, stream=True, finish=finish)
                assert whole_as_streamed(p, text, streamed, streamed_reason, finish) == \
                    (whole["content"], calls_of(whole), reason), (text, finish)


@pytest.mark.parametrize(("choice", "parser", "reply", "arguments"), [
    (None, "llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "city": "Rome"}}',
     '{"city": "Oslo", "city": "Rome"}'),
    (None, "hermes", '<tool_call>{"name": "get_weather", "arguments": {"x": [{"a": 1, "a": {"b": 2, "b": 3}}], '
                     '"x": null}}</tool_call>', '{"x": [{"a": 1, "a": {"b": 2, "b": 3}}], "x": null}'),
    (None, "llama3_json", '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"city\\": 1}"}',
     '{"city": "Oslo", "city": 1}'),
    ("required", None, '[{"name": "get_weather", "parameters": {"city": "Oslo", "city": "Rome"}}]',
     '{"city": "Oslo", "city": "Rome"}'),
])
def test_a_key_given_twice_in_the_arguments_reads_alike_streamed_or_whole(choice, parser, reply, arguments):
    """A stream sends `"city": "Oslo"` before it reads `"city": "Rome"`, so it writes the key twice; a whole reply
    wrote what json.loads keeps, the last alone. Both now write what the model wrote, which a client's json.loads reads
    as Python's does (the last)."""
    whole, reason = read_alike(plan(choice, parser), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) == [("get_weather", arguments)] and reason == "tool_calls"


@pytest.mark.parametrize(("choice", "parser", "reply", "call"), [
    (None, "llama3_json", '{"name": "get_weather", "parameters": {"a": 1}, "parameters": {"b": 2}}',
     ("get_weather", '{"a": 1}')),
    (None, "llama3_json", '{"name": "get_weather", "arguments": {"a": 1}, "parameters": {"b": 2}}',
     ("get_weather", '{"a": 1}')),
    (None, "hermes", '<tool_call>{"name": "get_weather", "parameters": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
     ("get_weather", '{"a": 1}')),
    ("required", None, '[{"name": "get_weather", "parameters": {"a": 1}, "parameters": {}}]',
     ("get_weather", '{"a": 1}')),
    (None, "llama3_json", '{"name": "get_time", "name": "get_weather", "parameters": {}}', ("get_time", "{}")),
    (None, "hermes", '<tool_call>{"name": "get_time", "arguments": {}, "name": ["x"]}</tool_call>',
     ("get_time", "{}")),
])
def test_a_name_or_arguments_given_twice_in_a_call_read_alike_streamed_or_whole(choice, parser, reply, call):
    """A stream sends a call once its name is read and its arguments begin, and cannot take it back for a later
    name or arguments; a whole reply took the last (json.loads), or "parameters" over "arguments" wherever written,
    and a stream refused a second name (the call as text, or one broken off). Both take the first written."""
    whole, reason = read_alike(plan(choice, parser), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) == [call] and whole["content"] == ("" if choice else None) and reason == "tool_calls"


@pytest.mark.parametrize(("reply", "calls", "content"), [
    ('[get_weather(city="Oslo", city="Rome")]', [("get_weather", '{"city": "Oslo"}')], ' city="Rome")]'),
    ("[get_time(), get_weather(a=1, b=[2], a=3)]", [("get_time", "{}"), ("get_weather", '{"a": 1, "b": [2]}')],
     " a=3)]"),
])
def test_a_pythonic_keyword_given_twice_reads_alike_streamed_or_whole(reply, calls, content):
    """ast parses `f(a=1, a=2)` (Python's compiler refuses it): a whole reply kept the last, while a stream, which
    sent the first, ended the calls there. The stream's call breaks off there, and the whole reply, as one whose
    call broke off, is its text."""
    streamed, reason = streamed_alike(plan(parser="pythonic"), reply, [1] * len(reply))
    assert (calls_of(streamed), streamed["content"]) == (calls, content)


@pytest.mark.parametrize("depth", [510, 511, 512, 700])
@pytest.mark.parametrize(("choice", "parser", "frame"), [
    (None, "llama3_json", '{"name": "get_time", "parameters": {"a": %s}}'),
    (None, "hermes", '<tool_call>{"name": "get_time", "arguments": {}, "id": %s}</tool_call>'),  # (a key skipped)
    ("required", None, '[{"parameters": {"a": %s}, "name": "get_time"}]'),
])
def test_values_nested_past_the_streams_depth_read_alike_streamed_or_whole(choice, parser, frame, depth):
    """A stream refuses JSON nested past MAX_DEPTH (512) in a call's values, so such a call breaks off there; a whole
    reply, read by json.loads, took it whole up to Python's recursion limit (near 1000)."""
    reply = frame % ("[" * depth + "]" * depth)
    streamed, reason = streamed_alike(plan(choice, parser), reply, [7] * (len(reply) // 7 + 1))
    empty = "" if choice else None  # (vLLM's content beside "required" calls; null beside "auto" ones)
    assert (streamed["content"] == empty) == (depth < (513 if "id" in frame else 512))  # (the arguments' object is one)


@pytest.mark.parametrize(("choice", "parser", "reply"), [
    (None, "llama3_json", '{"name": "get_time", "parameters": {}, "id": NaN}; {"name": "get_time", "parameters": {}}'),
    (None, "hermes", '<tool_call>{"name": "get_time", "arguments": {}, "id": [1e400]}</tool_call>'),
    (None, "hermes", '<tool_call>{"id": {"a": -Infinity}, "name": "get_time", "arguments": {}}</tool_call>'),
    ("required", None, '[{"name": "get_time", "parameters": {}, "id": 2e308}]'),
])
def test_a_value_json_cannot_hold_outside_the_arguments_reads_alike_streamed_or_whole(choice, parser, reply):
    """json.loads takes NaN, Infinity and 1e400 (inf), so a whole reply took a call with one under a key it skips;
    a stream refuses them where it reads them, so the call broke off there (or was text)."""
    whole, reason = read_alike(plan(choice, parser), reply, [1] * len(reply), [len(reply)])
    assert whole["content"] is not None


@pytest.mark.parametrize("reply", [
    "[get_weather(a=1, # then the city\n)]",  # (a comment after the trailing comma)
    "[get_weather(a=1,\\\n)]",  # (a line continuation)
    "[get_time(\\\n)]",
    "[get_time(# none\n), get_weather(a=1,  # c\n  )]",
])
def test_pythonic_comments_or_line_continuations_alone_are_no_argument_streamed_or_whole(reply):
    """What stands between a call's last comma (or its parenthesis) and its ")" may be only a comment or a line
    continuation, which ast skips; the stream parsed it as an argument and failed, breaking the call off there (or
    sending the reply as text)."""
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) and whole["content"] is None


@pytest.mark.parametrize("reply", [
    "[météo(ville='Oslo')]",
    "[me\u0301te\u0301o()]",  # (decomposed: Python reads identifiers NFKC)
    "[ｇet_time()]",  # (fullwidth: NFKC "get_time")
])
def test_pythonic_names_python_reads_read_alike_streamed_or_whole(reply):
    """ast reads a call to a tool with a non-ASCII name, and any identifier in its NFKC form; the stream took only
    ASCII names, so it sent such a reply as text."""
    meteo = {"type": "function", "function": {"name": "météo"}}
    p = ToolPlan.of([meteo, TIME], None, None, ToolOptions(parser="pythonic"))
    whole, reason = read_alike(p, reply, [1] * len(reply))
    assert calls_of(whole) and whole["content"] is None


@pytest.mark.parametrize("reply", [
    "[get_time(),\\\n get_time()]",  # (a backslash and a line's end: a line continuation, whitespace to ast)
    "[\\\nget_time()]",
    "[get_time\\\n()]",
    "[get_time()\\\r\n]",
])
def test_pythonic_line_continuations_between_calls_read_alike_streamed_or_whole(reply):
    """ast reads a line continuation between the list's calls (or after a name) as whitespace; the stream took the
    backslash for text, so it sent the reply, or what followed the first call, as content."""
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) and whole["content"] is None


@pytest.mark.parametrize("reply", [
    "[(get_time())]",  # (ast drops parentheses around an expression)
    "[get_time(), (get_weather(city='Oslo'))]",
    "[(get_weather)(city='Oslo')]",
    "[( # the time\n (get_time) ( ) )]",
])
def test_pythonic_calls_in_parentheses_read_alike_streamed_or_whole(reply):
    """ast reads a call in parentheses (or one whose name is) as the call; the stream took the parenthesis for text,
    so it sent the reply, or what followed the first call, as content."""
    whole, reason = read_alike(plan(parser="pythonic"), reply, [1] * len(reply), [len(reply)])
    assert calls_of(whole) and whole["content"] is None


# a differential check: random replies in each format, whole against streamed in random pieces, whole and cut

JSON_VALUES = ["1e5", "1E+05", "-0", "-0.0", "1.0", "1.50", "123456789012345678901234567890", "2e308", "NaN", "tru",
               '"\\ud83d\\ude00"', '"\\uD83D"', '"\\ude00\\ud83d"', '"\\u00e9\\/\\b\\n"', '"raw\ttab"', '"é😀"', '""',
               '"</tool_call>"', '"}]\\""', "true", "null", "[]", "{}"]
PY_VALUES = ["1e5", "-0.0", "1_000", "0x10", "'\\x41'", '"\\u00e9"', "'\\ud83d'", "'''a\"b'''", "r'\\d'", "b'x'",
             "None", "True", "{'a': (1, [2])}", "{1}", "1+2j", "'#),]'", "[1, # c\n 2]", "(\n'a'\n 'b')"]


def random_json(rng: random.Random, depth: int = 0) -> str:
    kind = rng.random()
    space = rng.choice(["", " ", "\n  ", "\t"])
    if kind < 0.6 or depth > 2:
        return rng.choice(JSON_VALUES)
    if kind < 0.8:
        return "[" + space + ("," + space).join(random_json(rng, depth + 1) for _ in range(rng.randrange(3))) + "]"
    keys = [rng.choice(['"a"', '"b"', '"\\u0061"', '""', '"é"']) for _ in range(rng.randrange(4))]
    return "{" + ("," + space).join(f"{k}{space}:{space}{random_json(rng, depth + 1)}" for k in keys) + space + "}"


def random_call(rng: random.Random, parser: str | None) -> str:
    name = rng.choice(["get_weather", "get_time"] + ["nope"] * (rng.random() < 0.1))
    if parser == "pythonic":
        args = ", ".join(f"{rng.choice(['a', 'b', 'city'])}={rng.choice(PY_VALUES)}" for _ in range(rng.randrange(3)))
        call = f"{name}({args}{rng.choice(['', ','])})"
        return f"({call})" if rng.random() < 0.1 else call
    key = rng.choice(["parameters"] if parser is None else ["parameters", "arguments"])
    pairs = [f'"name": "{name}"', f'"{key}": {random_json(rng, 1) if rng.random() < 0.2 else "{"}'
             + ", ".join(f'"k{i}": {random_json(rng, 1)}' for i in range(rng.randrange(3))) + "}"]
    return "{" + ", ".join(pairs[::rng.choice([1, -1])]) + "}"


def random_reply(rng: random.Random, parser: str | None) -> str:
    calls = [random_call(rng, parser) for _ in range(rng.choice([1, 1, 2, 3]))]
    text = rng.choice(["", "", " ", "Sure. ", "\n"])
    if parser == "hermes":
        return text + "".join(f"<tool_call>{rng.choice(['', chr(10)])}{c}</tool_call>{rng.choice(['', chr(10), ' x'])}"
                              for c in calls)
    if parser == "llama3_json":
        return text.strip() + rng.choice(["", "<|python_tag|>"]) + rng.choice(["; ", ";"]).join(calls) \
            + rng.choice(["", ";", " then"])
    return text.strip() + "[" + rng.choice([", ", ",\\\n", " # c\n,"]).join(calls) + rng.choice(["", ","]) + "]" \
        + rng.choice(["", "\n", " more"])


@pytest.mark.parametrize(("choice", "parser"), [("required", None), (None, "llama3_json"), (None, "hermes"),
                                                 (None, "pythonic")])
def test_random_replies_read_alike_streamed_or_whole(choice, parser):
    rng = random.Random(7)
    for _ in range(120):
        reply = random_reply(rng, parser)
        cut = reply[:rng.randrange(1, len(reply) + 1)]
        for text, finish in ((reply, "stop"), (cut, rng.choice(["stop", "length"]))):
            p = plan(choice, parser, rng.choice([None, False]))
            _, whole, reason = read(p, text, [len(text)], stream=False, finish=finish)
            sizes = [rng.randrange(1, 6) for _ in text]
            _, streamed, streamed_reason = read(p, text, sizes, stream=True, finish=finish)
            assert whole_as_streamed(p, text, streamed, streamed_reason, finish) == \
                (whole["content"], calls_of(whole), reason), (text, finish)


# what review found (helper, whole replies read as streams): each case failed before its mend

@pytest.mark.parametrize(("choice", "parser", "head"), [
    (None, "llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    (None, "hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": '),
    ("required", None, '[{"name": "get_weather", "parameters": {"city": '),
])
def test_a_word_that_no_json_value_begins_streams_as_content_as_it_comes(choice, parser, head):
    """A bare word where a call's value goes (`"city": Oslo`) is no JSON once no literal (true, false, null) or
    number begins so, but the reader held it until a character that is no letter ended it: nothing of it was sent,
    and the word grew a character at a time (`self.token += ch`, quadratic: a whole reply with 320k such characters
    took 2 s to read, where it had taken 0.2 s before whole replies were read as streams)."""
    reader = ReplyReader(plan(choice, parser), stream=True)
    reader.feed(head)
    sent = "".join(reader.feed(ch).content for ch in "Oslo" + "o" * 200)
    assert sent == "Oslo" + "o" * 200
    reply = head + "Oslo" + "o" * 200 + "}}"
    streamed, reason = streamed_alike(plan(choice, parser), reply, [1] * len(reply))
    assert calls_of(streamed) == [("get_weather", '{"city": ')] and streamed["content"] == reply[len(head):]


@pytest.mark.parametrize(("choice", "parser", "frame"), [
    (None, "llama3_json", '{"name": "get_time", "parameters": "{\\"a\\": %s}"}'),
    (None, "hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"a\\": %s}"}</tool_call>'),
])
@pytest.mark.parametrize("depth", [511, 512, 700])
def test_arguments_written_as_a_json_string_are_held_to_the_same_depth(choice, parser, frame, depth):
    """Arguments written as a JSON string of an object are read by the reader that reads them written as an object,
    to the same depth (MAX_DEPTH, 512, the object one); json.loads took them up to Python's recursion limit."""
    reply = frame % ("[" * depth + "]" * depth)
    _, whole, reason = read(plan(choice, parser), reply, [len(reply)], stream=False)
    assert (calls_of(whole) != []) == (depth < 512) and (whole["content"] is None) == (depth < 512)
    assert reason == ("tool_calls" if depth < 512 else "stop")


def merged(events: list) -> list:
    """Events with pieces of content, or of one call's arguments, in a row joined."""
    out: list = []
    for kind, text in events:
        if out and kind == out[-1][0] != "call":
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


@pytest.mark.parametrize(("choice", "parser"), [("required", None), (None, "llama3_json"), (None, "hermes"),
                                                 (None, "pythonic")])
def test_a_whole_reply_that_cannot_hold_a_call_is_content_at_once_as_a_stream_reads_it(choice, parser):
    """A whole reply in which no offered name can be written (read_whole's early exit: a 120k-character JSON answer
    is not read a character at a time) gives the events of reading it a character at a time: over the differential
    corpus, whole and cut, with the tools offered and with names it holds none of."""
    rng = random.Random(9)
    kind = RequiredStream if choice == "required" else PARSERS[parser].stream
    replies = [r for c, p, r in REPLIES + CUT_REPLIES if (c, p) == (choice, parser)]
    replies += [random_reply(rng, parser) for _ in range(150)]
    replies += ['{"results": [{"id": 1, "title": "get_time\\n"}], "name": "x"}', "", " ",
                '{"name": "get_\\u0074ime", "parameters": {}}', '{"name": "a\\/b", "parameters": {}}']
    early = 0
    for reply in replies:
        for text in {reply, reply[:rng.randrange(1, len(reply) + 1)] if reply else reply}:
            for names in (NAMES, frozenset({"get_time"}), frozenset({"nope", "get_weather_now"}), frozenset({"a/b"})):
                stream = kind(names, one_call=False)
                early += not stream.may_call(text)
                streamed = kind(names, one_call=False)
                expected = merged([e for ch in text for e in streamed.feed(ch)] + streamed.finish())
                assert merged(stream.read_whole(text)) == expected, (text, names)
    assert early > 100 if parser != "pythonic" else early == 0  # (the exit was taken; a Python name has other forms)


def test_a_reply_without_thoughts_reads_a_token_without_joining_deltas(monkeypatch):
    """A reply with no reasoning parser fed each token through an empty thoughts delta joined to the answer's (two
    more Deltas and their lists a token, ~2 us of a streamed token's ~40); it reads the answer alone, the same
    delta."""
    from tpgraph.server.reply import Delta

    def joined(*_):
        raise AssertionError("deltas joined")

    monkeypatch.setattr(Delta, "__add__", joined)
    reader = ReplyReader(ToolPlan(), stream=True)
    deltas = [reader.feed(t) for t in ("a", "", "b")]
    assert [d.fields(True) for d in deltas] == [{"content": "a"}, {"content": ""}, {"content": "b"}]
    assert [d.in_order() for d in deltas] == [["a"], [], ["b"]] and reader.contents == ["a", "b"]
