"""The request bodies: explicit nulls are the defaults, ids are integers, and what the server cannot honour is
refused rather than ignored."""

import json

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from tpgraph.errors import RequestError  # noqa: E402
from tpgraph.server.protocol import ChatRequest, CompletionRequest  # noqa: E402
from tpgraph.server.tools import ToolOptions

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_null_is_the_default_where_the_field_cannot_hold_null():
    nulls = dict.fromkeys(["n", "stream", "echo", "min_tokens", "ignore_eos", "skip_special_tokens",
                           "include_stop_str_in_output", "return_tokens_as_token_ids"])
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", **nulls, "max_tokens": None})
    assert (r.n, r.stream, r.echo, r.min_tokens, r.skip_special_tokens) == (1, False, False, 0, True)
    assert r.max_tokens == 16  # (the default, as vLLM's normalize_null_max_tokens)
    c = ChatRequest.model_validate({**CHAT, "logprobs": None, "add_generation_prompt": None, "n": None})
    assert (c.logprobs, c.add_generation_prompt, c.n) == (False, True, 1)
    with pytest.raises(ValidationError, match="prompt"):  # (a required field stays required)
        CompletionRequest.model_validate({"model": "m", "prompt": None})


@pytest.mark.parametrize("body", [{"prompt": [True, False]}, {"prompt": [[1, 2.0]]},
                                  {"prompt": "x", "stop_token_ids": [True]}, {"prompt": "x", "stop_token_ids": [2.0]}])
def test_ids_must_be_integers(body):
    with pytest.raises(ValidationError, match="token ids must be integers"):
        CompletionRequest.model_validate({"model": "m", **body})


@pytest.mark.parametrize(("kind", "field"), [
    *((CompletionRequest, f) for f in ("logprobs", "max_tokens", "n", "best_of", "seed", "top_k", "min_tokens",
                                       "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                       "repetition_penalty")),
    *((ChatRequest, f) for f in ("top_logprobs", "max_tokens", "max_completion_tokens", "n"))])
def test_a_number_must_not_be_true_or_false(kind, field):
    """pydantic takes true and false as the numbers 1 and 0: a completion's `"logprobs": true` (the chat API's
    form) silently asked for one alternative, `"max_tokens": true` for one token. A field of the wrong type is a 400,
    as logit_bias's values, the ids and the counts already are."""
    body = {"model": "m", "prompt": "x"} if kind is CompletionRequest else CHAT
    with pytest.raises(ValidationError, match="must be a number, not true or false"):
        kind.model_validate({**body, field: True})
    kind.model_validate({**body, field: 1})  # (a number is taken)


@pytest.mark.parametrize("extra,needle", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),  # ("auto")
    ({"functions": [{"name": "f"}]}, "send tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
])
def test_what_cannot_be_honoured_is_refused(extra, needle):
    body = ChatRequest.model_validate({**CHAT, **extra})
    with pytest.raises(RequestError, match=needle):
        body.checked_messages()
        body.tool_plan(ToolOptions())


@pytest.mark.parametrize("kind", [CompletionRequest, ChatRequest])
@pytest.mark.parametrize("field,value", [("logprob_token_ids", [5, 7]), ("thinking_token_budget", 100),
                                         ("repetition_detection", {"max_pattern_size": 4})])
def test_vllms_fields_this_server_does_not_honour_are_refused_not_ignored(kind, field, value):
    """vLLM's logprob_token_ids, thinking_token_budget and repetition_detection were dropped unread (extra fields): the
    reply ran without them and said nothing. Each is a 400 naming it, sampled or searched; null (and a budget of -1,
    vLLM's unlimited) asks nothing and is taken."""
    body = {**(CHAT if kind is ChatRequest else {"prompt": "x"}), "logprobs": 2 if kind is CompletionRequest else True}
    for extra in ({}, {"use_beam_search": True, "temperature": 0.0}):
        request = kind.model_validate({**body, **extra, field: value})
        with pytest.raises(RequestError, match=f"{field} is not supported"):
            request.beam_search_params(4, None) if extra else request.sampling_params(4, None)
    for neutral in (None, -1) if field == "thinking_token_budget" else (None,):
        kind.model_validate({**body, field: neutral}).sampling_params(4, None)


@pytest.mark.parametrize("kind", [CompletionRequest, ChatRequest])
def test_an_empty_logprob_token_ids_asks_nothing_sampled_or_searched(kind):
    """logprob_token_ids [] names no token, so asks nothing, as an empty list asks nothing of a beam search's unused
    fields (stop_token_ids [], bad_words []): it was refused as if it asked for entries."""
    body = {**(CHAT if kind is ChatRequest else {"prompt": "x"}), "logprob_token_ids": []}
    kind.model_validate(body).sampling_params(4, None)
    kind.model_validate({**body, "use_beam_search": True, "stop_token_ids": []}).beam_search_params(4, None)


@pytest.mark.parametrize("text", [5, {"a": 1}, ["x"]])
def test_a_text_part_whose_text_is_no_string_is_refused(text):
    """A content part's text went through str(): a null text became the word "None" in the prompt, silently."""
    body = ChatRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": text}]}]})
    with pytest.raises(RequestError, match=r"messages\[0\].content\[1\].text must be a string"):
        body.checked_messages()


def test_a_text_or_refusal_part_whose_text_is_null_is_dropped_as_vllms_parser_drops_it():
    """vLLM's _parse_chat_message_content_part (renderers/chat_utils/parse_chat_message_content.py) skips a "text" or
    "refusal" part whose text is null or missing (PART_TYPES_TO_SKIP_NONE_CONTENT), with a warning; it was a 400 here.
    Its string content format drops any text part that comes to nothing (`if parse_res:`), so input_text too; the
    openai format hands such a part's None to the template, which is refused here rather than written as "None"."""
    from tpgraph.chat import text_messages

    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None},
                                             {"type": "text"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": None}, {"type": "text", "text": "c"},
                                                  {"type": "refusal", "text": "d"}]}]
    body = ChatRequest.model_validate({**CHAT, "messages": messages})
    assert body.checked_messages() == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]
    assert body.checked_messages("openai") == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]}]
    assert [m["content"] for m in text_messages(messages)] == ["a\nb", "c"]  # (TPEngine.chat's, as LLM.chat's)
    other = [{"role": "user", "content": [{"type": "input_text", "text": None}, {"type": "text", "text": "e"}]}]
    assert ChatRequest.model_validate({**CHAT, "messages": other}).checked_messages() == [
        {"role": "user", "content": "e"}]
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\].text must be a string"):
        ChatRequest.model_validate({**CHAT, "messages": other}).checked_messages("openai")


def test_a_developer_message_reaches_the_template_in_its_own_role_with_its_tools_as_vllms():
    """vLLM maps no role before templating: a developer message keeps "developer", and its parser
    (_parse_chat_message_content) gives it its own `tools` (None where it has none), the key a template reads a
    developer message's tools from. The server dropped them; neither gave the key."""
    from tpgraph.chat import text_messages

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "developer", "content": "be brief", "tools": [tool]}, {"role": "developer", "content": "ok"},
                {"role": "user", "content": "x"}]
    body = ChatRequest.model_validate({**CHAT, "messages": messages})
    expected = [{"role": "developer", "content": "be brief", "tools": [tool]},
                {"role": "developer", "content": "ok", "tools": None}, {"role": "user", "content": "x"}]
    assert body.checked_messages() == expected
    assert text_messages(messages) == expected  # (TPEngine.chat's, as LLM.chat's)
    with pytest.raises(RequestError, match=r"messages\[0\].tools must be a list"):
        ChatRequest.model_validate({**CHAT, "messages": [
            {"role": "developer", "content": "a", "tools": "f"}]}).checked_messages()


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    """A message's text parts were joined with nothing between them ("Describe:" and "the sky" became
    "Describe:the sky"); vLLM joins them with a newline, so the prompt (and /tokenize's count) is vLLM's."""
    body = ChatRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe:"}, {"type": "text", "text": "the sky"}]}]})
    assert body.checked_messages() == [{"role": "user", "content": "Describe:\nthe sky"}]


def test_what_changes_nothing_is_accepted():
    for extra in ({"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
                  {"parallel_tool_calls": True}):
        body = ChatRequest.model_validate({**CHAT, **extra})
        assert body.checked_messages() == [{"role": "user", "content": "x"}]
        assert body.tool_plan(ToolOptions()).mode == "none"


def test_logit_bias_keys_are_token_ids_on_both_endpoints():
    """JSON object keys are strings: they must name token ids; the values reach SamplingParams unconverted, so true
    is refused there rather than taken as 1.0."""
    for body in ({"model": "m", "prompt": "x"}, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatRequest
        r = kind.model_validate({**body, "logit_bias": {"50": -100, "7": 2.5, "9": 0}})
        assert r.sampling_params(4, None).logit_bias == ((7, 2.5), (50, -100.0))
    for bias, needle in (({"x": 1}, "keys must be token ids"), ({"-3": 1}, "keys must be token ids"),
                         ({"٣": 1}, "keys must be token ids"), ({"7": True}, "must be a finite number"),
                         ({"7": 1, "07": 2}, "names token 7 twice"), ({"7": float("nan")}, "must be a finite")):
        with pytest.raises(RequestError, match=needle):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": bias}).sampling_params(4, None)


def test_logit_bias_values_past_100_are_clamped_as_vllms_server_clamps_them():
    """vLLM's server (SamplingParams.from_optional) clamps each value to [-100, 100]; this server refused 101 with a
    400. Offline, SamplingParams still refuses it (vLLM's offline one takes any value)."""
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {"7": 150, "9": -1e9, "3": 5}})
    assert r.sampling_params(4, None).logit_bias == ((3, 5.0), (7, 100.0), (9, -100.0))


@pytest.mark.parametrize("options, refusal", [
    ({"whitespace_pattern": " "}, "whitespace_pattern is not taken"),
    ({"disable_additional_properties": True}, "disable_additional_properties=True is not taken"),
    ({"backend": "outlines"}, "backend='outlines' is not taken"),
    ({"disable_any_whitespace": "no"}, "disable_any_whitespace is true or false, got 'no'"),
])
def test_structured_outputs_options_the_server_cannot_honour_are_refused_as_offline(options, refusal):
    """whitespace_pattern, disable_additional_properties and a backend other than xgrammar were taken unchanged
    here (and backend was "not one of json, ..."), while StructuredOutputsParams refused them: one policy for both."""
    from tpgraph.engine.structured import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    for form in ({"structured_outputs": {"json": schema, **options}},
                 {"guided_json": schema, "structured_outputs": options}):
        with pytest.raises(RequestError, match=refusal):
            ChatRequest.model_validate({**CHAT, **form}).sampling_params(4, None)
    with pytest.raises(RequestError, match=refusal):
        StructuredOutputsParams(json=schema, **options)


@pytest.mark.parametrize("extra, refusal", [
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": r"[ ]?"},
     "guided_whitespace_pattern is not supported.*xgrammar's.*disable_any_whitespace"),
    ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern is not supported.*disable_any_whitespace"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]})},
     "structural_tag is not supported.*give one of response_format"),
])
def test_vllms_legacy_structural_tag_and_whitespace_pattern_fields_are_refused_not_dropped(extra, refusal):
    """vLLM's guided_whitespace_pattern and structural_tag, top-level fields beside guided_json and the others, were
    not fields here: dropped unsaid, a structural_tag's reply ran unconstrained. They are refused as
    structured_outputs' whitespace_pattern and structural_tag are, on both endpoints, sampled or searched (one
    refusal of what is not served, UNSERVED's, with what serves instead)."""
    for body in ({**CHAT, **extra}, {"model": "m", "prompt": "x", **extra}):
        endpoint = ChatRequest if "messages" in body else CompletionRequest
        with pytest.raises(RequestError, match=refusal):
            endpoint.model_validate(body).sampling_params(4, None)
        if "guided_json" not in body:  # (a search's own refusal of a grammar would come first)
            with pytest.raises(RequestError, match=refusal):
                endpoint.model_validate({**body, "use_beam_search": True}).beam_search_params(4, None)
    assert ChatRequest.model_validate({**CHAT, "structural_tag": None}).sampling_params(4, None).structured is None


def test_guided_decoding_backend_naming_another_backend_is_refused_where_a_grammar_is_asked():
    """vLLM's guided_decoding_backend (beside the guided_* fields) becomes the request's backend, and its engine
    refuses a request-level backend other than its own ("Request-level structured output backend selection is no
    longer supported"); here it was ignored, and a guided_json asking for outlines ran on xgrammar unsaid. It is read
    as structured_outputs' backend is: xgrammar or auto taken, another refused; without a grammar it asks nothing,
    as vLLM's from_optional makes no params of it (clients send it on every request)."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for form in ({"guided_json": schema}, {"response_format": {"type": "json_object"}},
                 {"tools": tools, "tool_choice": "required"},
                 {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}):
        body = ChatRequest.model_validate({**CHAT, **form, "guided_decoding_backend": "outlines"})
        with pytest.raises(RequestError, match="backend='outlines' is not taken"):
            body.sampling_params(4, None, tools=body.tool_plan(ToolOptions()))
        structured = set()
        for taken in ("xgrammar", "auto", None):
            body = ChatRequest.model_validate({**CHAT, **form, "guided_decoding_backend": taken})
            structured.add(body.sampling_params(4, None, tools=body.tool_plan(ToolOptions())).structured)
        assert len(structured) == 1 and None not in structured  # (a backend taken is a check alone: no change)
    for endpoint, body in ((ChatRequest, CHAT), (CompletionRequest, {"model": "m", "prompt": "x"})):
        assert endpoint.model_validate({**body, "guided_decoding_backend": "outlines"}).sampling_params(
            4, None).structured is None
    with pytest.raises(RequestError, match="backend='lm-format-enforcer' is not taken"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "guided_regex": "a",
                                          "guided_decoding_backend": "lm-format-enforcer"}).sampling_params(4, None)


def test_disable_any_whitespace_false_is_honoured_on_json_as_offline():
    """disable_any_whitespace: false asks for JSON with free whitespace (vLLM's xgrammar default); it was dropped
    here, the request compiled without. True, null or absent is this server's default; backend xgrammar or auto is
    taken; on a regex, grammar or choice the option has nothing to change."""
    from tpgraph.engine.structured import StructuredOutput, StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    spaced = StructuredOutput("json_schema", StructuredOutput.json_schema(schema).spec, any_whitespace=True)
    cases = [({"structured_outputs": {"json": schema, "disable_any_whitespace": False}}, spaced),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
               "structured_outputs": {"disable_any_whitespace": False, "backend": "auto"}}, spaced),
             ({"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
              StructuredOutput("json_object", any_whitespace=True)),
             ({"structured_outputs": {"json": schema, "disable_any_whitespace": True, "backend": "xgrammar"}},
              StructuredOutput.json_schema(schema)),
             ({"structured_outputs": {"json": schema, "disable_any_whitespace": None}},
              StructuredOutput.json_schema(schema)),
             ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}}, StructuredOutput("regex", "a"))]
    for extra, want in cases:
        assert ChatRequest.model_validate({**CHAT, **extra}).sampling_params(4, None).structured == want, extra
        body = {"model": "m", "prompt": "x", **extra}
        assert CompletionRequest.model_validate(body).sampling_params(4, None).structured == want, extra
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=False) == spaced
    assert StructuredOutputsParams(json_object=True, disable_any_whitespace=False).any_whitespace
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=True, backend="auto") == cases[3][1]
    assert StructuredOutputsParams(regex="a", disable_any_whitespace=False) == StructuredOutput("regex", "a")
    # (the SPMD check digests repr(SamplingParams): equal calls, by either form, digest alike; the option shows)
    from tpgraph import SamplingParams

    as_dict = SamplingParams(structured_outputs={"json": schema, "disable_any_whitespace": False})
    spaced_too = SamplingParams(guided_decoding=StructuredOutputsParams(json=json.dumps(schema),
                                                                        disable_any_whitespace=False))
    assert repr(as_dict) == repr(spaced_too) != repr(SamplingParams(structured_outputs={"json": schema}))


def test_response_format_and_guided_fields_become_one_structured_output():
    from tpgraph.engine.structured import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    cases = [({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
              StructuredOutput.json_schema(schema)),
             ({"guided_json": schema}, StructuredOutput.json_schema(schema)),
             ({"guided_regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
             ({"guided_choice": ["x", "y"]}, StructuredOutput.choice(["x", "y"])),
             ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
             ({"structured_outputs": {"json": schema}}, StructuredOutput.json_schema(schema)),
             ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
             ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput.choice(["x", "y"])),
             ({"structured_outputs": {"grammar": 'root ::= "a"', "json": None}},
              StructuredOutput("grammar", 'root ::= "a"')),
             ({"structured_outputs": {"regex": "a", "json_object": False, "disable_any_whitespace": True}},
              StructuredOutput("regex", "a")),
             ({"response_format": {"type": "text"}}, None), ({}, None)]
    for extra, want in cases:
        assert ChatRequest.model_validate({**CHAT, **extra}).sampling_params(4, None).structured == want, extra
        body = {"model": "m", "prompt": "x", **extra}
        assert CompletionRequest.model_validate(body).sampling_params(4, None).structured == want, extra
    for extra, needle in (({"response_format": {"type": "xml"}}, "response_format type 'xml' is not one of"),
                          # (no type: vLLM's ResponseFormat requires one; taken as text, the schema was left unheld)
                          ({"response_format": {"json_schema": {"name": "s", "schema": schema}}},
                           "response_format type None is not one of"),
                          ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
                          # (vLLM's JsonSchemaResponseFormat has name: str, required, as OpenAI's)
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
                           "needs json_schema.name"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": schema}}},
                           "needs json_schema.name"),
                          ({"guided_choice": []}, "a non-empty list of non-empty strings"),
                          ({"guided_json": "{not json"}, "the JSON schema is not valid JSON"),
                          ({"guided_regex": "a", "guided_choice": ["a"]}, "give one of"),
                          ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml is not one of"),
                          ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "give one of")):
        with pytest.raises(RequestError, match=needle):
            ChatRequest.model_validate({**CHAT, **extra}).sampling_params(4, None)


def test_content_parts_vllm_reads_as_text_are_text():
    """vLLM reads a plain string part, and input_text, output_text (the Responses API's), refusal parts (an
    assistant's earlier refusal, sent back as OpenAI's SDK gives it) and thinking parts (its "thinking" key) as text;
    they were a 400."""
    body = ChatRequest.model_validate({**CHAT, "messages": [
        {"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}, {"type": "refusal", "refusal": "d"},
                                          {"type": "thinking", "thinking": "e"}]}]})
    assert body.checked_messages() == [{"role": "user", "content": "a\nb"},
                                       {"role": "assistant", "content": "c\nd\ne"}]
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\].refusal must be a string"):
        ChatRequest.model_validate({**CHAT, "messages": [{"role": "assistant", "content": [
            {"type": "refusal", "refusal": 5}]}]}).checked_messages()


def test_empty_text_parts_are_dropped_where_the_parts_are_joined_as_vllm_drops_them():
    """vLLM's _parse_chat_message_content_parts keeps a part only where its parse is truthy: in the "string" content
    format an empty text is dropped before the texts are joined ("a", "", "b" is "a\nb", not "a\n\nb"); in "openai"
    each part is a {"type": "text"} object, kept however empty, and a tool message's parts are then joined with
    their empty texts."""
    parts = ["a", {"type": "text", "text": ""}, "", {"type": "input_text", "text": "b"}]
    body = ChatRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": parts},
                                                            {"role": "tool", "content": parts, "tool_call_id": "c"}]})
    user, tool = body.checked_messages("string")
    assert user["content"] == "a\nb" and tool["content"] == "a\nb"
    user, tool = body.checked_messages("openai")
    assert user["content"] == [{"type": "text", "text": t} for t in ("a", "", "", "b")]
    assert tool["content"] == "a\n\n\nb"
    only_empty = ChatRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": ["", ""]}]})
    assert only_empty.checked_messages("string")[0]["content"] == ""


def test_beam_search_params_are_vllms_to_beam_search_params():
    """n is the beam width; max_tokens, temperature (the request's, else generation_config's, else 1.0),
    length_penalty, ignore_eos and include_stop_str_in_output reach the search; sampling_params is never its
    params (it was taken and ignored once: the client got sampled text for the beams it asked for)."""
    from tpgraph.engine.beam_search import BeamSearchParams

    for body in ({"model": "m", "prompt": "x"}, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatRequest
        r = kind.model_validate({**body, "use_beam_search": True, "n": 3, "length_penalty": 0.5, "ignore_eos": True,
                                 "include_stop_str_in_output": True, "top_p": 1, "stop": [], "seed": 4,
                                 "top_k": -1})  # (-1 turns top_k off, as 0 does: vLLM's and SamplingParams')
        assert r.beam_search_params(7, None) == BeamSearchParams(
            beam_width=3, max_tokens=7, ignore_eos=True, temperature=1.0, length_penalty=0.5,
            include_stop_str_in_output=True)
        assert r.beam_search_params(7, 6, {"temperature": 0.6}).temperature == 0.6
        assert kind.model_validate({**body, "use_beam_search": True, "temperature": 0}).beam_search_params(
            2, None, {"temperature": 0.6}).temperature == 0.0
        with pytest.raises(RequestError, match="takes beam_search_params, not sampling_params"):
            r.sampling_params(4, None)
        kind.model_validate({**body, "length_penalty": 2.0}).sampling_params(4, None)  # (unused without a search)


@pytest.mark.parametrize("fields, message", [
    ({"top_p": 0.9}, "top_p is not used by a beam search, which takes n, max_tokens, temperature, length_penalty"),
    ({"top_k": 5}, "top_k is not used by a beam search"),
    ({"presence_penalty": 0.5}, "presence_penalty is not used by a beam search"),
    ({"stop": ["a"]}, "stop is not used by a beam search"),
    ({"stop_token_ids": [3]}, "stop_token_ids is not used by a beam search"),
    ({"min_tokens": 2}, "min_tokens is not used by a beam search"),
    ({"logit_bias": {"5": 1}}, "logit_bias is not used by a beam search"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids is not used by a beam search"),
    ({"bad_words": ["x"]}, "bad_words is not used by a beam search"),
    ({"prompt_logprobs": 0}, "prompt_logprobs is not used by a beam search"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens is not used by a beam search"),
    ({"guided_regex": "[0-9]+"}, "structured outputs .* are not supported with use_beam_search"),
    ({"response_format": {"type": "json_object"}}, "structured outputs"),
    ({"n": 0}, r"n must be between 1 and \d+, got 0 \(the beam width, with use_beam_search\)"),
    ({"length_penalty": True}, None),
    ({"temperature": -1}, r"temperature must be in \[0.0, 2.0\], got -1"),
    ({"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true"),
])
def test_what_a_beam_search_would_not_honour_is_refused(fields, message):
    for body in ({"model": "m", "prompt": "x"}, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatRequest
        if message is None:  # (as the other numbers: true is no 1.0)
            with pytest.raises(ValidationError, match="length_penalty"):
                kind.model_validate({**body, "use_beam_search": True, **fields})
            continue
        with pytest.raises(RequestError, match=message):
            kind.model_validate({**body, "use_beam_search": True, **fields}).beam_search_params(4, None)


def test_a_beam_searchs_logprobs_stream_and_echo():
    """Each token's alternatives are its step's 2 * n candidates; a completion's search returns no echo's
    log-probabilities; both endpoints take stream (a completion's is the whole reply as one event, as vLLM's)."""
    search = {"model": "m", "prompt": "x", "use_beam_search": True, "n": 2}
    assert CompletionRequest.model_validate(search).beam_search_params(4, 4).beam_width == 2
    with pytest.raises(RequestError, match=r"logprobs 5 is more than use_beam_search returns: .* 2 \* n = 4"):
        CompletionRequest.model_validate(search).beam_search_params(4, 5)
    with pytest.raises(RequestError, match=r"top_logprobs 5 is more than use_beam_search returns"):
        ChatRequest.model_validate({**CHAT, "use_beam_search": True, "n": 2}).beam_search_params(
            4, 5, logprobs_name="top_logprobs")
    CompletionRequest.model_validate({**search, "stream": True}).beam_search_params(4, None)
    with pytest.raises(RequestError, match="echo with logprobs is not supported with use_beam_search"):
        CompletionRequest.model_validate({**search, "echo": True}).beam_search_params(4, 0)
    CompletionRequest.model_validate({**search, "echo": True}).beam_search_params(4, None)
    with pytest.raises(RequestError, match="max_tokens must be >= 1, got 0"):
        CompletionRequest.model_validate({**search, "echo": True}).beam_search_params(0, None)
    ChatRequest.model_validate({**CHAT, "use_beam_search": True, "stream": True,
                                "stream_options": {"include_usage": True}}).beam_search_params(4, None)


def test_spaces_between_special_tokens_reaches_the_sampling_params():
    """vLLM's request field: it was dropped unread (unknown fields are ignored), so False changed nothing."""
    for body in ({"model": "m", "prompt": "x"}, CHAT):
        request = (CompletionRequest if "prompt" in body else ChatRequest).model_validate(
            {**body, "skip_special_tokens": False, "spaces_between_special_tokens": False})
        assert request.sampling_params(4, None).spaces_between_special_tokens is False
        assert type(request).model_validate(body).sampling_params(4, None).spaces_between_special_tokens is True


def test_names_and_an_assistants_reasoning_reach_the_template():
    """vLLM gives the chat template a message's name whatever its role (a multi-party chat's speakers), and an earlier
    assistant turn's reasoning (interleaved thinking) as reasoning and reasoning_content; only a tool message's name
    reached it."""
    body = ChatRequest.model_validate({**CHAT, "messages": [
        {"role": "user", "content": "hi", "name": "ana"},
        {"role": "assistant", "content": "yes", "name": "bot", "reasoning_content": "she greets"},
        {"role": "assistant", "content": "ok", "reasoning": "again"},
        {"role": "user", "content": "x", "name": 3}]})  # (a name that is no string is left out, as vLLM's)
    assert body.checked_messages() == [
        {"role": "user", "content": "hi", "name": "ana"},
        {"role": "assistant", "content": "yes", "name": "bot", "reasoning": "she greets",
         "reasoning_content": "she greets"},
        {"role": "assistant", "content": "ok", "reasoning": "again", "reasoning_content": "again"},
        {"role": "user", "content": "x"}]


def test_offline_chat_gives_an_assistants_reasoning_to_the_template_as_reasoning_content_too():
    """vLLM's LLM.chat parses messages as its server does (_parse_chat_message_content): an assistant's `reasoning`
    reaches the template as `reasoning` and `reasoning_content` (the key Qwen3's and DeepSeek's templates read).
    TPEngine.chat passed the message as given, so such a template wrote no earlier thoughts where the server and vLLM
    write them."""
    from tpgraph.chat import text_messages

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning": "she greets"}]
    served = ChatRequest.model_validate({**CHAT, "messages": messages}).checked_messages()
    assert text_messages(messages) == served == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning": "she greets", "reasoning_content": "she greets"}]
    assert messages[1] == {"role": "assistant", "content": "ok", "reasoning": "she greets"}  # (the caller's kept)


def test_a_schema_given_as_text_nested_past_the_stack_is_a_400():
    """A JSON schema sent as text (guided_json, structured_outputs.json) nested deeper than json.loads can follow
    raised RecursionError, a 500; it is a request's mistake, as an earlier call's arguments nested so deep are."""
    for extra in ({"guided_json": "[" * 100_000}, {"structured_outputs": {"json": '{"a":' * 100_000}}):
        with pytest.raises(RequestError, match="the JSON schema is not valid JSON"):
            ChatRequest.model_validate({**CHAT, **extra}).sampling_params(4, None)
    from tpgraph.engine.structured import StructuredOutput

    with pytest.raises(RequestError, match="a choice is a non-empty list"):  # (the offline API's spec text)
        StructuredOutput("choice", "[" * 100_000)


@pytest.mark.parametrize("kind", [["text"], {"a": 1}])
def test_a_content_part_whose_type_is_no_string_is_a_400(kind):
    """A part's type was looked up in TEXT_PARTS as it came: a list or an object raised TypeError (unhashable), a
    500, where any other unknown type is a 400 that names it."""
    part = {"type": kind, "text": "a"}
    body = ChatRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": [part]}]})
    with pytest.raises(RequestError, match="message content of type .* is not supported"):
        body.checked_messages()


def test_an_assistants_reasoning_content_is_read_beside_a_null_reasoning():
    """A client that sends back both keys of a reply whose thoughts came as reasoning_content alone (an SDK's model
    dump: "reasoning": null) lost them: the null reasoning was taken, reasoning_content never read."""
    body = ChatRequest.model_validate({**CHAT, "messages": [
        {"role": "assistant", "content": "ok", "reasoning": None, "reasoning_content": "she greets"}]})
    assert body.checked_messages() == [{"role": "assistant", "content": "ok", "reasoning": "she greets",
                                        "reasoning_content": "she greets"}]


def test_top_logprobs_zero_needs_no_logprobs_as_vllm_reads_it():
    """vLLM's check_logprobs refuses top_logprobs without logprobs only where it asks for alternatives (> 0): a client
    that sends top_logprobs 0 beside logprobs false (its SDK's default) is served without log-probabilities. It was a
    400 here."""
    plain = ChatRequest.model_validate({**CHAT, "top_logprobs": 0})
    assert plain.logprobs_count() is None
    assert ChatRequest.model_validate({**CHAT, "top_logprobs": 0, "logprobs": False}).logprobs_count() is None
    assert ChatRequest.model_validate({**CHAT, "top_logprobs": 0, "logprobs": True}).logprobs_count() == 0
    with pytest.raises(RequestError, match="top_logprobs needs logprobs: true"):
        ChatRequest.model_validate({**CHAT, "top_logprobs": 2}).logprobs_count()
    with pytest.raises(RequestError, match="top_logprobs must be between 0 and 20, got -1"):
        ChatRequest.model_validate({**CHAT, "top_logprobs": -1}).logprobs_count()


def test_prompt_logprobs_zero_is_taken_with_stream_as_vllm_takes_it():
    """vLLM's check_logprobs refuses prompt_logprobs with stream: true only where it asks for alternatives (> 0); a
    stream sends none, so 0 asks nothing of it (and runs no prompt scoring here). It was a 400."""
    for body in ({"model": "m", "prompt": "x"}, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatRequest
        params = kind.model_validate({**body, "stream": True, "prompt_logprobs": 0}).sampling_params(4, None)
        assert params.prompt_logprobs is None
        with pytest.raises(RequestError, match="prompt_logprobs are not available with stream: true"):
            kind.model_validate({**body, "stream": True, "prompt_logprobs": 1}).sampling_params(4, None)
        assert kind.model_validate({**body, "prompt_logprobs": 0}).sampling_params(4, None).prompt_logprobs == 0


def test_empty_stream_options_are_taken_without_stream_as_vllm_takes_them():
    """vLLM's validate_stream_options refuses stream_options without stream: true only where they ask for something
    (a non-empty object); {} beside stream false was a 400 here."""
    for body in ({"model": "m", "prompt": "x"}, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatRequest
        kind.model_validate({**body, "stream_options": {}}).sampling_params(4, None)
        with pytest.raises(RequestError, match="stream_options is only allowed with stream: true"):
            kind.model_validate({**body, "stream_options": {"include_usage": False}}).sampling_params(4, None)


def test_stream_options_that_name_a_field_need_a_stream_whatever_its_value():
    """vLLM refuses any stream_options object with a key in it beside stream false: {"include_usage": null} (a field
    given, its null read as the default) and a key this server does not know were taken here, as if {} was sent."""
    for body in ({"model": "m", "prompt": "x"}, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatRequest
        for options in ({"include_usage": None}, {"continuous_usage_stats": None}, {"other": 1}):
            with pytest.raises(RequestError, match="stream_options is only allowed with stream: true"):
                kind.model_validate({**body, "stream_options": options}).sampling_params(4, None)
        streamed = {**body, "stream": True, "stream_options": {"include_usage": None}}
        kind.model_validate(streamed).sampling_params(4, None)


def test_a_completions_prompt_embeds_is_refused_not_ignored():
    """vLLM's prompt_embeds (a completion's prompt as embeddings) was dropped unread: the reply was the text prompt's
    alone. A 400 naming it, sampled or searched; null asks nothing."""
    for extra in ({}, {"use_beam_search": True, "temperature": 0.0}):
        request = CompletionRequest.model_validate({"prompt": "x", **extra, "prompt_embeds": "AAAA"})
        with pytest.raises(RequestError, match="prompt_embeds is not supported"):
            request.beam_search_params(4, None) if extra else request.sampling_params(4, None)
    CompletionRequest.model_validate({"prompt": "x", "prompt_embeds": None}).sampling_params(4, None)


@pytest.mark.parametrize("kind", [CompletionRequest, ChatRequest])
def test_the_servers_seed_is_a_signed_64_bit_integer_as_vllms(kind):
    """vLLM's request models bound seed to torch.long's range; offline SamplingParams takes an unsigned 64-bit one
    too (as vLLM's LLM does), and the server's request keeps vLLM's bound: a larger one is a 400."""
    body = {"model": "m", "prompt": "x"} if kind is CompletionRequest else CHAT
    assert kind.model_validate({**body, "seed": 2 ** 63 - 1}).seed == 2 ** 63 - 1
    assert kind.model_validate({**body, "seed": -(2 ** 63)}).seed == -(2 ** 63)
    with pytest.raises(ValidationError, match="seed"):
        kind.model_validate({**body, "seed": 2 ** 63})
