"""Structured outputs (SamplingParams.structured, through xgrammar) on the built-in model: every constrained
sample matches its choice, regular expression or JSON schema and stops there, overlapped or not, beside rows that
are not constrained and keep their own tokens; bad specs are refused when the request is taken."""

import dataclasses
import json
import math
import re

import pytest

pytest.importorskip("xgrammar")

from tpgraph import SamplingParams, TPEngine  # noqa: E402
from tpgraph.engine.structured import StructuredOutput  # noqa: E402
from tpgraph.errors import RequestError  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}
CONSTRAINED = [
    (StructuredOutput.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    (StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    (StructuredOutput.json_schema(SCHEMA), lambda t: set(json.loads(t)) == {"ok", "color"}
     and isinstance(json.loads(t)["ok"], bool) and json.loads(t)["color"] in ("red", "green")),
    (StructuredOutput("grammar", 'root ::= "<" [a-c]+ ">"'), lambda t: re.fullmatch("<[a-c]+>", t)),
]
PROMPTS = ["Answer:", "Code:", "JSON:", "Tag:"]


def engine(**kw):
    return TPEngine(device="cpu", max_model_len=128, max_num_seqs=8, block_size=8, **kw)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in_turn"])
def test_every_constrained_sample_matches_and_stops_beside_free_rows(overlap):
    free = SamplingParams(temperature=0.0, max_tokens=12)
    # (greedy rows take one sample, as vLLM's)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, n=1 if t == 0.0 else 2, structured=spec)
              for t, (spec, _) in zip((0.0, 0.9, 0.0, 1.0), CONSTRAINED, strict=True)]
    with engine(overlap_scheduling=overlap) as e:
        alone = e.generate(["free"], free)[0].outputs[0].token_ids
        outs = e.generate([*PROMPTS, "free"], [*params, free])
    for out, (_, matches) in zip(outs, CONSTRAINED, strict=False):
        for sample in out.outputs:
            assert sample.finish_reason == "stop" and matches(sample.text), (sample.text, sample.finish_reason)
    assert outs[-1].outputs[0].token_ids == alone  # (the masks touch only their own rows)


def test_overlapped_and_in_turn_engines_sample_the_same_constrained_tokens():
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=spec)
              for s, (spec, _) in enumerate(CONSTRAINED)]
    texts = []
    for overlap in (True, False):
        with engine(overlap_scheduling=overlap) as e:
            texts.append([o.outputs[0].text for o in e.generate(PROMPTS, params)])
    assert texts[0] == texts[1]


def test_constrained_steps_stay_overlapped():
    """A constrained row's mask needs its last token: the step in flight is read between the next step's forwards
    and its draw, so steps stay overlapped (launched before the last was read), and every reply matches."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured=CONSTRAINED[2][0])
    with engine() as e:
        e.core.add_request("c", e.encode("JSON:"), params)
        e.core.add_request("free", e.encode("free"), SamplingParams(temperature=0.0, max_tokens=30))
        overlapped, text = [], ""
        while e.core.has_work:
            updates = e.core.step()
            overlapped.append(e.core.timing.overlapped)
            text += "".join(u.text for u in updates if u.request_id == "c")
    assert CONSTRAINED[2][1](text), text
    assert sum(overlapped) >= len(overlapped) - 3, overlapped  # (all but the first step and the drain)


def test_a_lark_grammar_holds_the_output_as_its_ebnf_twin_does():
    """vLLM's grammar field takes Lark's syntax too (a grammar where no rule is written with ::=; clients send Lark,
    the syntax of OpenAI's and llguidance's grammars): it was compiled as EBNF and refused. Seeded, the Lark grammar
    and its EBNF twin give the same tokens; a broken one is refused naming Lark's error."""
    from tpgraph.engine.structured import is_lark

    lark = """// a tag of a, b and c
start: "<" LETTERS ">"
LETTERS: /[a-c]+/
"""
    assert is_lark(lark) and is_lark('start: "x"  # not EBNF: root ::= x') and not is_lark('root ::= "x"\n')
    assert not is_lark('# a rule\nroot ::= "<" [a-c]+ ">"')
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40)
    with engine() as e:
        got, want = (e.generate(["Tag:"], dataclasses.replace(params, structured=StructuredOutput("grammar", g)))[0]
                     .outputs[0] for g in (lark, CONSTRAINED[3][0].spec))
        with pytest.raises(RequestError, match="the grammar cannot be used: Lark error at line 1.*no start rule"):
            e.generate(["x"], dataclasses.replace(params, structured=StructuredOutput("grammar", 'tag: "<" ">"')))
    assert re.fullmatch("<[a-c]+>", got.text) and got.token_ids == want.token_ids and got.finish_reason == "stop"


@pytest.mark.parametrize(("spec", "needle"), [
    (StructuredOutput("regex", "[0-9"), "the regex cannot be used"),
    (StructuredOutput("grammar", "root ::= nothing_defined"), "the grammar cannot be used"),
    # a grammar of no string (every sample aborted at its first token, an error logged, where it was taken)
    (StructuredOutput("grammar", "root ::= a\na ::= root"), "the grammar cannot be used: it matches nothing"),
    (StructuredOutput.json_schema({"type": "no such type"}), "the json schema cannot be used"),
    # what xgrammar compiles without, leaving replies that break their schema (["a", "a"], "karynii", {"a": 0})
    (StructuredOutput.json_schema({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "uniqueItems": True}),
     "uniqueItems at # is not supported"),
    (StructuredOutput.json_schema({"properties": {"s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}}),
     "pattern with minLength or maxLength at #/properties/s"),
    (StructuredOutput.json_schema({"properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}),
     "dependentRequired at #"),
    (StructuredOutput.json_schema({"anyOf": [{"allOf": [{"type": "string"}, {"maxLength": 3}]}]}),
     "allOf with more than one schema at #/anyOf/0"),
    (StructuredOutput.json_schema({"$ref": "#/$defs/n", "$defs": {"n": {"type": "integer"}}, "maximum": 5}),
     r"\$ref beside maximum at #"),
    (StructuredOutput.json_schema({"type": "array", "items": {"type": "integer", "not": {"const": 0}}}),
     "not at #/items"),
    (StructuredOutput.json_schema({"type": "integer", "multipleOf": 2.5}), "multipleOf on a non-integer at #"),
    (StructuredOutput.json_schema({"type": "string", "format": "uri", "maxLength": 9}),
     "format with minLength or maxLength at #"),
    (StructuredOutput.json_schema({"oneOf": []}), "an empty oneOf at #"),  # (its reply was "", no JSON)
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}),
     "required 'b' without a properties entry beside it at #"),  # (its reply was {"a": 1}, or {})
])
def test_a_spec_that_does_not_compile_is_refused_when_the_request_is_taken(spec, needle):
    with engine() as e:
        with pytest.raises(RequestError, match=needle):
            e.generate(["x"], SamplingParams(max_tokens=4, structured=spec))
        assert e.generate(["x"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # (and it keeps serving)


def test_what_xgrammar_leaves_unenforced_is_what_is_refused():
    """unenforced_keyword against xgrammar itself: what it names, xgrammar's grammar lets a breaking reply through;
    what it passes, xgrammar holds (a format xgrammar has no grammar for keeps its string's length bounds)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from tpgraph.engine.structured import unenforced_keyword

    for schema, breaking, refused in [
        ({"type": "string", "format": "binary", "maxLength": 3}, '"abcdef"', False),
        ({"type": "string", "format": "password", "minLength": 3}, '"ab"', False),
        ({"type": "string", "format": "date", "maxLength": 3}, '"2024-01-01"', True),
        ({"type": ["integer", "null"], "multipleOf": 5}, "7", False),
        ({"type": "integer", "multipleOf": 5.0}, "7", False),
        ({"type": "integer", "multipleOf": 2.5}, "3", True),
        ({"type": ["number", "null"], "multipleOf": 5}, "7", True),
        # a required name is held only where the same schema's properties list it
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}", False),
        ({"type": "object", "required": ["b"], "additionalProperties": True}, "{}", True),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a": 1}', True),
        ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "{}", True),
        ({"$defs": {"o": {"type": "object", "required": ["z"]}}, "$ref": "#/$defs/o"}, "{}", True),
        # xgrammar reads a schema with anyOf, oneOf or allOf by it alone: what is beside it is dropped
        ({"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"],
          "additionalProperties": False, "anyOf": [{"type": "object"}]}, "{}", True),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}], "maximum": 5}, "7", True),
        ({"type": "integer", "maximum": 3, "allOf": [{"minimum": 1}]}, '"x"', True),
        ({"type": "string", "oneOf": [{"maxLength": 3}, {"pattern": "^a"}]}, "5", True),
        ({"anyOf": [{"type": "integer"}], "oneOf": [{"type": "integer", "minimum": 3}]}, "1", True),
        # ... which changes nothing where it is an annotation, or a type each branch is of already
        ({"type": "object", "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"]}]}, "{}", False),
        ({"type": ["integer", "null"], "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}], "title": "t",
          "discriminator": {"propertyName": "k"}, "default": None}, "0", False),
        ({"type": "number", "oneOf": [{"const": 1}, {"enum": [2, 3.5]}, {"anyOf": [{"type": "integer"}]}]}, '"4"',
         False),
        # a number's, string's, array's or object's bounds are held only under a type (one its keywords give too)
        ({"type": "object", "properties": {"r": {"minimum": 1, "maximum": 5}}, "required": ["r"]}, '{"r": 9}', True),
        ({"minLength": 2}, '"a"', True),
        ({"maxProperties": 0}, '{"a": 1}', True),
        ({"items": {"type": "integer"}, "minItems": 2}, "[1]", False),
        ({"type": ["integer", "string"], "minimum": 3}, "1", False),
        ({"properties": {"a": {}}, "minProperties": 1}, "{}", False),
        # a pattern with a quote, a backslash or a control character is written unescaped: the reply is no JSON
        ({"type": "string", "pattern": '^"[a-z]+"$'}, '""ab""', True),
        ({"type": "string", "pattern": "^C:\\\\.*$"}, '"C:\\x"', True),
        ({"type": "string", "pattern": "^\\d+\\t\\d+$"}, '"1\t2"', True),
        ({"type": "string", "pattern": '^[^"]*$'}, '"a\\"', False),  # (its JSON-string regex: none of them)
        ({"type": "string", "pattern": "^https?://[a-z.]+$"}, '"http://a"b"', False),
    ]:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        assert _is_grammar_accept_string(grammar, breaking) is refused, schema
        assert (unenforced_keyword(schema) is not None) is refused, schema


def test_schemas_that_xgrammar_enforces_are_not_refused_for_look_alikes():
    """A property named as a keyword, annotations beside a $ref, one allOf, multipleOf on integers (Optional[int]'s
    ["integer", "null"] too), a false uniqueItems and a format xgrammar reads past beside maxLength (pydantic's
    conbytes) are enforced (or change nothing): they compile, and replies match."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"not": {"type": "integer", "multipleOf": 3}, "uniqueItems": {
        "$ref": "#/$defs/b", "description": "a flag"}, "c": {"allOf": [{"enum": ["x", "y"]}]},
        "d": {"type": "array", "items": {"const": 1}, "uniqueItems": False, "maxItems": 2},
        "e": {"type": "string", "format": "binary", "maxLength": 2}, "f": {"type": ["integer", "null"],
                                                                         "multipleOf": 5}},
        "required": ["not", "uniqueItems", "c", "d", "e", "f"], "additionalProperties": False,
        "$defs": {"b": {"type": "boolean"}}}
    with engine() as e:
        outs = e.generate(["JSON:"], SamplingParams(temperature=1.0, seed=4, n=4, max_tokens=60,
                                                    structured=StructuredOutput.json_schema(schema)))[0].outputs
    for sample in outs:
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), schema)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: StructuredOutput("yaml"), "kind must be one of"),
    (lambda: StructuredOutput("choice", '["a", ""]'), "non-empty list of non-empty strings"),
    (lambda: StructuredOutput.choice("yes"), "a choice is a list of strings, got 'yes'"),
    (lambda: StructuredOutput("json_schema", "[1]"), "a JSON schema is an object"),
    (lambda: StructuredOutput("regex", ""), "the regex is empty"),
    (lambda: SamplingParams(structured=StructuredOutput("regex", "a"), ignore_eos=True),
     "cannot be combined with ignore_eos"),
    (lambda: SamplingParams(structured=StructuredOutput("regex", "a"), min_tokens=2, max_tokens=4), "or min_tokens"),
    (lambda: SamplingParams(structured="json"), "structured must be a StructuredOutput"),
])
def test_bad_structured_params_are_refused(make, needle):
    with pytest.raises(RequestError, match=needle):
        make()


def fail_import(monkeypatch, module: str, error: Exception) -> None:
    """From now on (in this test), importing `module` raises `error`."""
    import builtins

    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == module:
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)


def test_without_xgrammar_a_constrained_request_is_refused_with_the_install_hint(monkeypatch):
    with engine() as e:
        fail_import(monkeypatch, "xgrammar", ImportError("no xgrammar"))
        with pytest.raises(RequestError, match=r"pip install 'tpgraph\[structured\]'"):
            e.generate(["x"], SamplingParams(max_tokens=4, structured=StructuredOutput("json_object")))


def test_choices_outside_the_bmp_and_json_objects_come_out_as_asked():
    """A choice with an emoji (json.dumps would escape it to a surrogate pair, read as two lone surrogates) and
    json_object (an object, compact: xgrammar's builtin JSON grammar takes arrays and whitespace anywhere)."""
    params = [SamplingParams(temperature=1.0, seed=s, n=4, max_tokens=60, structured=spec) for s, spec in
              enumerate([StructuredOutput.choice(["😀", "ok"]), StructuredOutput("json_object")])]
    with engine() as e:
        emoji, obj = e.generate(["Pick:", "JSON:"], params)
    assert {c.text for c in emoji.outputs} <= {"😀", "ok"} and "😀" in {c.text for c in emoji.outputs}
    for sample in obj.outputs:
        if sample.finish_reason == "stop":
            assert isinstance(json.loads(sample.text), dict)
        assert sample.text.startswith("{") and not re.search(r"[\t\r\n]", sample.text), sample.text


def test_json_with_any_whitespace_takes_whitespace_between_tokens_and_the_default_does_not():
    """disable_any_whitespace=False (StructuredOutput.any_whitespace) compiles JSON as vLLM's xgrammar backend does,
    with free whitespace between tokens; by default ", " and ": " are the only spaces."""
    from tpgraph.engine.structured import GrammarCompiler, StructuredOutputsParams
    from tpgraph.tokenizer import builtin_tokenizer

    grammars = GrammarCompiler(builtin_tokenizer(), 258, (257,))
    spaced, compact = '{ "ok" :true,\n  "color" : "red" }', '{"ok": true, "color": "red"}'
    for asked in (dict(json=SCHEMA), dict(json_object=True)):
        free = StructuredOutputsParams(**asked, disable_any_whitespace=False)
        for spec, text, ok in [(free, spaced, True), (free, compact, True),
                               (StructuredOutputsParams(**asked), spaced, False),
                               (StructuredOutputsParams(**asked), compact, True)]:
            matcher = grammars.matcher(spec)
            assert (matcher.accept_string(text) and matcher.accept_token(257)) is ok, (asked, spec, text)
    with pytest.raises(RequestError, match="any_whitespace holds JSON only"):
        StructuredOutput("regex", "a", any_whitespace=True)


def test_the_compiler_is_bounded_says_why_it_refuses_and_needs_an_eos():
    from tpgraph.engine.structured import GrammarCompiler
    from tpgraph.tokenizer import builtin_tokenizer

    grammars = GrammarCompiler(builtin_tokenizer(), 258, (257,))
    for i in range(GrammarCompiler.CACHED + 5):
        grammars.compile(StructuredOutput("regex", f"a{{{i + 1}}}"))
    assert len(grammars._cache) == GrammarCompiler.CACHED
    with pytest.raises(RequestError) as refused:
        grammars.compile(StructuredOutput("regex", "[0-9"))
    assert "/project" not in str(refused.value) and "Unclosed" in str(refused.value)
    with pytest.raises(RequestError, match="need an EOS token id"):
        GrammarCompiler(builtin_tokenizer(), 258, ()).compile(StructuredOutput("json_object"))


def test_the_server_compiles_a_grammar_before_the_engine_thread_adds_its_request(monkeypatch):
    """EngineService.precompile, which the server's reader thread calls before it queues a request: the engine's add
    then finds the grammar compiled (no compile inside a step); a spec that does not compile is left for the add to
    refuse."""
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    spec = StructuredOutput("regex", "[a-f]{4}")
    with engine() as e:
        service = EngineService(e.core, ControlPlane(e.state))
        service.precompile(SamplingParams(max_tokens=8, structured=spec))
        service.precompile(SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "[0-9")))  # (no raise)
        compiled = []
        real = e.core.grammars._compile
        monkeypatch.setattr(e.core.grammars, "_compile", lambda *a: compiled.append(a) or real(*a))
        out = e.generate(["x"], SamplingParams(max_tokens=8, structured=spec))[0].outputs[0]
    assert re.fullmatch("[a-f]{4}", out.text) and compiled == []


def test_the_warm_up_masks_1_3_and_16_rows_and_skips_a_broken_xgrammar(monkeypatch):
    """xgrammar's mask kernel takes the constrained rows' count, which Triton compiles apart at 1, 3 and 16: the
    warm-up masks each. An xgrammar that is found but does not import (a wheel without its FFI) leaves the server
    starting, and constrained requests refused with the install hint."""
    from tpgraph.engine import sampler as sampler_module

    masked = set()
    real = sampler_module.apply_masks
    monkeypatch.setattr(sampler_module, "apply_masks", lambda x, m: masked.add(len(m)) or real(x, m))
    with TPEngine(device="cpu", max_model_len=128, max_num_seqs=16, block_size=8, num_kv_blocks=128,
                  max_num_batched_tokens=256) as e:
        e.warm_up()
    assert {1, 3, 16} <= masked

    fail_import(monkeypatch, "xgrammar", OSError("libtvm_ffi.so: cannot open shared object file"))
    with engine() as e:
        assert e.warm_up() > 0
        with pytest.raises(RequestError, match=r"tpgraph\[structured\].*OSError: libtvm_ffi"):
            e.generate(["x"], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "a")))


def test_length_bounded_json_strings_take_escapes_and_refuse_raw_control_characters():
    """xgrammar 0.2.9 writes a string with maxLength as a run of [^"\\\r\n]: raw control characters (invalid JSON)
    in, escapes out (its issue 800). json_schema_grammar mends it; a schema without such strings is left as it was."""
    from xgrammar.testing import _is_grammar_accept_string

    from tpgraph.engine.structured import json_schema_grammar

    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3},
                                                          "t": {"type": "array", "items": {"type": "string",
                                                                                           "minLength": 1}}},
                         "required": ["s", "t"], "additionalProperties": False})
    grammar = json_schema_grammar(schema)
    for text, ok in [('{"s": "a\\"b", "t": ["\\n"]}', True), ('{"s": "\\u00e9", "t": []}', True),
                     ('{"s": "a\x01", "t": []}', False), ('{"s": "x", "t": ["\t"]}', False),
                     ('{"s": "abcd", "t": []}', False), ('{"s": "", "t": [""]}', False)]:
        assert _is_grammar_accept_string(grammar, text) is ok, text
    for bounds in ({"maxLength": 1}, {"minLength": 1, "maxLength": 1}):  # (xgrammar writes these inline)
        one = json_schema_grammar(json.dumps({"type": "object", "properties": {"s": {"type": "string", **bounds}},
                                              "required": ["s"]}))
        assert _is_grammar_accept_string(one, '{"s": "\\n"}') and not _is_grammar_accept_string(one, '{"s": "\x01"}')
    plain = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}})
    assert str(json_schema_grammar(plain)) == str(__import__("xgrammar").Grammar.from_json_schema(
        plain, any_whitespace=False))


def test_a_grammar_compiled_on_two_threads_at_once_is_compiled_once():
    """A follower's background compile (compile_soon) and its step's add ask for the same grammar: the second
    waits for the first; a refusal reaches both."""
    import threading
    import time

    with engine() as e:
        grammars, calls = e.core.grammars, []
        real = grammars._compile

        started = threading.Event()

        def slow(compiler, spec):
            calls.append(spec)
            started.set()
            time.sleep(0.2)
            return real(compiler, spec)

        grammars._compile = slow
        spec = StructuredOutput("regex", "[a-c]{3}")
        grammars.compile_soon(spec)
        assert started.wait(5) and spec in grammars._compiling  # (the background thread is compiling)
        got = [None, None]
        readers = [threading.Thread(target=lambda i=i: got.__setitem__(i, grammars.compile(spec))) for i in (0, 1)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert calls == [spec] and got[0] is got[1] is grammars.compile(spec)
        bad = StructuredOutput("regex", "[0-9")
        started.clear()
        grammars.compile_soon(bad)
        assert started.wait(5) and bad in grammars._compiling
        with pytest.raises(RequestError, match="the regex cannot be used"):
            grammars.compile(bad)
        assert calls.count(bad) == 1 and not grammars._compiling


def test_a_followers_background_compiles_run_a_few_at_once(monkeypatch):
    """A follower rank compiled the grammars rank 0 told it of on one thread: behind a large one, every other
    request's add compiled its own in a step. They compile a few at once (COMPILE_THREADS, vLLM's pool), each
    grammar whole and right."""
    import threading

    from tpgraph.engine import structured

    monkeypatch.setattr(structured, "COMPILE_THREADS", 2, raising=False)  # (a pool of 2 on any machine)
    with engine() as e:
        grammars = e.core.grammars
        real, together = grammars._compile, threading.Barrier(2, timeout=5)

        def met(compiler, spec):  # (each waits for the other: both compile at once, or neither does)
            together.wait()
            return real(compiler, spec)

        grammars._compile = met
        specs = [StructuredOutput("regex", "[a-c]{3}"), StructuredOutput("regex", "[0-9]{2}")]
        for spec in specs:
            grammars.compile_soon(spec)
        grammars._background.shutdown(wait=True)
        assert all(grammars.compiled(spec) for spec in specs) and not together.broken
        grammars._compile = real
        assert grammars.can_begin_with(specs[1], set(e.tokenizer.encode("7", add_special_tokens=False).ids))


def test_a_grammar_held_off_until_the_end_of_thoughts():
    """structured_after (a reasoning model's "</think>"): the output is free until it has that text, and held to the
    grammar after it. The marker here is one token the bias makes certain; the grammar then forbids it."""
    with engine() as e:
        marker = e.tokenizer.encode("Z", add_special_tokens=False).ids
        assert len(marker) == 1
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=12, logit_bias={marker[0]: 100},
                                structured=StructuredOutput("regex", "[a-c]{3}"), structured_after="Z")
        out = e.generate(["x"], params)[0].outputs[0]
        assert out.text.startswith("Z") and re.fullmatch("[a-c]{3}", out.text[1:]), out.text
        assert out.finish_reason == "stop"
        held = e.generate(["x"], SamplingParams(**{**params.__dict__, "structured_after": None}))[0].outputs[0]
        assert re.fullmatch("[a-c]{3}", held.text), held.text  # (from the first token: the bias is masked away)


def test_grammar_state_waits_for_its_marker_tokens():
    from tpgraph.engine.structured import GrammarState

    class Matcher:
        def __init__(self) -> None:
            self.taken: list[int] = []

        def accept_token(self, token: int) -> bool:
            self.taken.append(token)
            return token != 99

        def is_terminated(self) -> bool:
            return False

    state = GrammarState(Matcher(), after=(5, 6))
    for token in (5, 7, 6, 5):
        assert state.accept(token) and not state.masks
    assert state.accept(6) and state.masks and state.matcher.taken == []  # (the marker is not the grammar's)
    assert state.accept(1) and not state.accept(99) and state.matcher.taken == [1, 99]
    with pytest.raises(RequestError, match="structured_after"):
        SamplingParams(structured_after="</think>")


def test_masks_leave_each_constrained_row_its_grammars_tokens_and_the_others_whole():
    """apply_masks on the CPU (its bitmask in pageable memory there, its rows a list): a constrained row keeps only
    the tokens its grammar can take next, a row between them keeps every logit."""
    import torch

    from tpgraph.engine.structured import GrammarCompiler, GrammarState, apply_masks
    from tpgraph.tokenizer import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    grammars = GrammarCompiler(tokenizer, 258, (257,))
    logits = torch.randn(3, 258)
    masked = logits.clone()
    apply_masks(masked, [(0, GrammarState(grammars.matcher(StructuredOutput("regex", "[a-c]+")))),
                         (2, GrammarState(grammars.matcher(StructuredOutput("regex", "[xy]"))))])
    kept = [[tokenizer.decode([t]) for t in row.isfinite().nonzero().flatten().tolist()] for row in masked]
    assert kept[0] == ["a", "b", "c"] and kept[2] == ["x", "y"]
    assert torch.equal(masked[1], logits[1])
    for row in (0, 2):  # (the tokens kept keep their logits)
        assert torch.equal(masked[row][masked[row].isfinite()], logits[row][masked[row].isfinite()])


def test_masks_cost_the_constrained_rows_not_the_whole_batch():
    """A batch with one structured row among many: its mask is filled on the host, and uploaded, for that row alone.
    The host's bitmask was [batch, vocab / 32], every row filled with -1 and copied to the device each step, so one
    JSON request made every step's host work grow with the whole batch (4 MB a step: 256 rows, a 128K vocabulary)."""
    import torch

    from tpgraph.engine.structured import GrammarCompiler, GrammarState, apply_masks
    from tpgraph.tokenizer import builtin_tokenizer

    class Filling:  # the matcher, noting the host bitmask each fill writes into
        def __init__(self, matcher) -> None:
            self.matcher, self.shapes = matcher, []

        def fill_next_token_bitmask(self, bitmask, index):
            self.shapes.append((tuple(bitmask.shape), index))
            return self.matcher.fill_next_token_bitmask(bitmask, index)

        def is_terminated(self) -> bool:
            return self.matcher.is_terminated()

    tokenizer = builtin_tokenizer()
    grammars = GrammarCompiler(tokenizer, 258, (257,))
    first = Filling(grammars.matcher(StructuredOutput("regex", "[a-c]+")))
    second = Filling(grammars.matcher(StructuredOutput("regex", "[xy]")))
    logits = torch.randn(64, 258)
    masked = logits.clone()
    apply_masks(masked, [(37, GrammarState(first)), (5, GrammarState(second))])
    assert first.shapes == [((2, 9), 0)] and second.shapes == [((2, 9), 1)]  # (258 tokens: 9 words of 32 bits)
    kept = [[tokenizer.decode([t]) for t in row.isfinite().nonzero().flatten().tolist()] for row in masked]
    assert kept[37] == ["a", "b", "c"] and kept[5] == ["x", "y"]
    others = [r for r in range(64) if r not in (5, 37)]
    assert torch.equal(masked[others], logits[others])


def test_a_refused_grammar_is_not_compiled_again_by_the_add_after_the_servers_precompile():
    """The server's bridge compiles a new grammar on a thread of its own (EngineService.precompile) so that the
    engine thread, adding the request, compiles nothing in a step. A refusal was not kept, so the add compiled the
    grammar again on the engine thread, stalling every stream's step (a grammar that matches nothing compiles whole
    before it is refused). A refusal is kept as a compiled grammar is: the add raises it at once."""
    with engine() as e:
        grammars, calls = e.core.grammars, []
        real = grammars._compile
        grammars._compile = lambda compiler, spec: calls.append(spec) or real(compiler, spec)
        empty = StructuredOutput("grammar", "root ::= a\na ::= root")
        with pytest.raises(RequestError, match="it matches nothing"):
            grammars.compile(empty)
        assert grammars.compiled(empty)  # (the bridge queues it at once: compile answers at once)
        with pytest.raises(RequestError, match="it matches nothing"):
            e.generate(["x"], SamplingParams(max_tokens=4, structured=empty))
        assert calls == [empty]


def test_a_compile_that_fails_otherwise_still_releases_its_waiters():
    """A failure other than xgrammar's refusals (MemoryError, say) is raised to the compiling thread and to every
    thread waiting for that compile; the next ask compiles again instead of waiting for good."""
    with engine() as e:
        grammars, spec = e.core.grammars, StructuredOutput("regex", "[a-c]{2}")
        real, failures = grammars._compile, [MemoryError("std::bad_alloc")]

        def failing(compiler, spec_):
            if failures:
                raise failures.pop()
            return real(compiler, spec_)

        grammars._compile = failing
        with pytest.raises(MemoryError):
            grammars.compile(spec)
        assert not grammars._compiling and grammars.compile(spec) is not None


def test_a_sequence_that_finishes_while_its_next_row_is_launched_leaves_nothing_behind():
    """The step in flight is read inside the next launch (a constrained row): a sequence it finishes is in that
    launch too. Its row is drawn and dropped, with no placeholder left in its tokens and no penalty slot held
    (helper-82's case: a penalized choice beside a free request)."""
    with engine() as e:
        core = e.core
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, frequency_penalty=0.5,
                                structured=StructuredOutput.choice(["yes", "no", "maybe"]))
        core.add_request("c", e.encode("Answer:"), params)
        core.add_request("free", e.encode("free"), SamplingParams(temperature=0.0, max_tokens=30))
        seq = core.requests["c"].seqs[0]
        while core.has_work:
            core.step()
        assert seq.num_pending == 0 and -1 not in seq.output_ids
        assert core.runner.penalties.num_held == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in_turn"])
def test_a_token_the_grammar_refuses_brings_no_logprob(monkeypatch, overlap):
    """A refused token ends its sample and is dropped: its log-probabilities go with it, so the sample keeps one
    entry per token (the refusal's update came with the dropped token's, one entry too many)."""
    from tpgraph.engine.structured import GrammarState

    accept, seen = GrammarState.accept, []

    def refuse_the_third(self, token):
        seen.append(token)
        return accept(self, token) if len(seen) < 3 else False

    monkeypatch.setattr(GrammarState, "accept", refuse_the_third)
    with engine(overlap_scheduling=overlap) as e:
        out = e.generate(["JSON:"], SamplingParams(temperature=0.0, max_tokens=20, logprobs=1,
                                                   structured=StructuredOutput("regex", "[a-z]{10}")))[0].outputs[0]
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    assert len(out.logprobs) == 2 and all(t in e for e, t in zip(out.logprobs, out.token_ids, strict=True))


def test_allowed_ids_that_the_grammar_cannot_begin_with_are_refused_when_the_request_is_taken():
    """A choice of digits with allowed_token_ids of letters: no first token is left. It was taken, and every sample
    ended "abort" with nothing in it; it is refused with the reason. Allowed ids it can begin with are taken."""
    digits = StructuredOutput("regex", "[0-9]+")
    with engine() as e:
        letters = tuple(e.tokenizer.encode("ab", add_special_tokens=False).ids)
        with pytest.raises(RequestError, match="can begin with none of allowed_token_ids"):
            e.generate(["x"], SamplingParams(max_tokens=4, structured=digits, allowed_token_ids=letters))
        nine = tuple(e.tokenizer.encode("9", add_special_tokens=False).ids)
        out = e.generate(["x"], SamplingParams(max_tokens=3, structured=digits, allowed_token_ids=letters + nine))
        assert out[0].outputs[0].text == "999"


def test_log_probabilities_are_of_what_the_grammar_allows():
    """vLLM applies the grammar's bitmask to the logits before its sampler, so the log-probabilities it reports (its
    raw ones too) are of the tokens the grammar allows: the greedy token is the likeliest (rank 1), one the grammar
    forces has log-probability 0, and a step's allowed tokens share all the probability. They were the model's own,
    before the mask."""
    choice = StructuredOutput.choice(["yes", "no"])
    with engine() as e:
        out = e.generate(["Answer:"], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2,
                                                     structured=choice))[0].outputs[0]
        first = {t for t in (e.tokenizer.encode(w, add_special_tokens=False).ids[0] for w in ("yes", "no"))}
    assert out.text in ("yes", "no") and len(out.logprobs) == len(out.token_ids) > 1
    assert all(entry[t].rank == 1 for entry, t in zip(out.logprobs, out.token_ids, strict=True))
    assert sum(math.exp(out.logprobs[0][t].logprob) for t in first) == pytest.approx(1.0, abs=1e-5)
    assert all(entry[t].logprob == pytest.approx(0.0, abs=1e-5)
               for entry, t in zip(out.logprobs[1:], out.token_ids[1:], strict=True))
