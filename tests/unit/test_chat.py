"""Chat templates render exactly as HF's apply_chat_template; generation_config supplies stop ids and defaults."""

import json
from pathlib import Path

import pytest
from tpgtest.chat_fixtures import EOS_ID, EOT_ID, make_chat_checkpoint

from tpgraph import RequestError, SamplingParams, TPEngine
from tpgraph.chat import ChatTemplate, GenerationDefaults, special_tokens, tokenizer_config
from tpgraph.engine.config import EngineConfig
from tpgraph.errors import CheckpointError

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "  Capital of Peru?  "},
     {"role": "assistant", "content": "Lima"}, {"role": "user", "content": "And Chile — ¿ñ? 你好"}],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ckpt))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_hf(ckpt, hf_tokenizer, messages, add_generation_prompt):
    ours = ChatTemplate.from_dir(ckpt, "").render(messages, add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system")


def test_engine_encodes_chat_as_hf_and_stops_on_generation_config_ids(ckpt, hf_tokenizer):
    with TPEngine(str(ckpt), device="cpu", load_format="dummy", max_num_seqs=2, max_model_len=128,
                  num_kv_blocks=40) as engine:
        for messages in CONVERSATIONS:
            ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert engine.encode(messages) == list(ids)
        assert set(engine.core.eos_ids) == {EOS_ID, EOT_ID}  # config.json's and generation_config's
        assert engine.default_params().temperature == 0.6 and engine.default_params().top_p == 0.9
        with pytest.raises(RequestError, match="only user and assistant messages"):
            engine.encode([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}])
        out = engine.generate(CONVERSATIONS[0], engine.default_params(max_tokens=4, seed=1))
        assert len(out[0].outputs[0].token_ids) <= 4


def test_generation_defaults_and_bad_files(tmp_path):
    assert GenerationDefaults.from_dir(None) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7, "top_k": 20, "do_sample": false}')
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults((7,), {"top_k": 20})
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 64}')
    assert GenerationDefaults.from_dir(tmp_path).max_tokens == 64
    for limit in ("0", "true", "\"64\"", "null"):  # (not a limit: none is taken)
        (tmp_path / "generation_config.json").write_text(f'{{"max_new_tokens": {limit}}}')
        assert GenerationDefaults.from_dir(tmp_path).max_tokens is None
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(CheckpointError, match="cannot read .*chat_template.jinja"):
        ChatTemplate.from_dir(tmp_path, "")
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        GenerationDefaults.from_dir(tmp_path)
    assert ChatTemplate.from_dir(tmp_path, "") is None  # no tokenizer_config.json: no template
    with pytest.raises(CheckpointError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_the_generation_tag_renders_its_body_as_hf_does(ckpt, hf_tokenizer):
    """HF's {% generation %} block (assistant masks for training) is part of some checkpoints' templates."""
    source = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n"
              "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    messages = CONVERSATIONS[1][1:]
    ours = ChatTemplate(source, {"bos_token": "<s>"}).render(messages)
    assert "assistant: Lima" in ours and ours.endswith("assistant: ")
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=source.replace("{{ bos_token }}", "<s>"),
                                              tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_the_template_file_comes_before_the_configs_and_needs_no_config(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages[0]['content'] }}")
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate.from_dir(tmp_path, "").render(messages) == "FILE Hi"  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "CONFIG {{ messages[0][\'content\'] }}"}')
    assert ChatTemplate.from_dir(tmp_path, "").render(messages) == "FILE Hi"  # as transformers reads them


def test_builtin_model_has_a_template():
    with TPEngine(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20) as engine:
        text = engine.render_chat([{"role": "user", "content": "hi"}])
        assert text == "<|begin_of_text|><|user|>\nhi\n<|assistant|>\n"
        assert engine.encode([{"role": "user", "content": "hi"}])[0] == 256  # BOS once, from the template


def test_chat_renders_each_conversation_with_its_options_and_completes_it():
    """vLLM's LLM.chat: one conversation or a list of them, rendered with the chat options (continue_final_message,
    add_generation_prompt) and completed as the rendered text's ids would be, BOS once; the prompt is that text."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    hi = [{"role": "user", "content": "hi"}]
    go_on = [*hi, {"role": "assistant", "content": "The answer is"}]
    with TPEngine(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20) as engine:
        (one,) = engine.chat(hi, greedy)
        assert one.prompt == engine.render_chat(hi) and one.prompt_token_ids == engine.encode(hi)
        assert one.outputs[0].token_ids == engine.generate(hi, greedy)[0].outputs[0].token_ids
        both = engine.chat([hi, go_on], greedy, continue_final_message=True, add_generation_prompt=False)
        assert both[1].prompt == engine.render_chat(go_on, False, continue_final_message=True)
        assert both[1].prompt.endswith("The answer is")
        assert both[1].prompt_token_ids.count(256) == 1  # (BOS from the template alone)
        with pytest.raises(RequestError, match="a conversation"):
            engine.chat("hi", greedy)


def test_template_variables_and_continuing_the_final_message():
    """vLLM's chat_template_kwargs reach the template as its variables (not over the request's own); with
    continue_final_message the text ends where the last message's text does, as apply_chat_template cuts it."""
    template = ChatTemplate("{% if greet %}hello {% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                            "</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is "}]
    assert template.render(messages[:1], variables={"greet": True}) == "hello <user>hi</user><assistant>"
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) == (
        "<user>hi</user><assistant>The answer is ")
    # the text is cut where the last message's ends, even when the template's closing text repeats it
    tail = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "t"}]
    assert template.render(tail, add_generation_prompt=False, continue_final_message=True) == (
        "<user>hi</user><assistant>t")
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert template.render(empty, add_generation_prompt=False, continue_final_message=True) == (
        "<user>hi</user><assistant>")
    dropped = ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(RequestError, match="does not write the last message's text"):
        dropped.render(tail, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(RequestError, match="may not set messages"):
        template.render(messages, variables={"messages": []})
    with pytest.raises(RequestError, match="needs add_generation_prompt false"):
        template.render(messages, continue_final_message=True)


def test_the_requests_own_chat_options_win_over_chat_template_kwargs_as_in_vllm():
    """vLLM merges the request's add_generation_prompt and continue_final_message over its chat_template_kwargs
    (merge_kwargs: the fields win), and a `tokenize` there is apply_chat_template's own option, which no template
    reads. add_generation_prompt in chat_template_kwargs was a 400 here, and the other two reached the template as
    variables."""
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}"
                            "|{{ continue_final_message | default('unset') }}|{{ tokenize | default('unset') }}")
    hi = [{"role": "user", "content": "hi"}]
    assert template.render(hi, variables={"add_generation_prompt": False}) == "<user>hi<assistant>|unset|unset"
    assert template.render(hi, add_generation_prompt=False, variables={"add_generation_prompt": True}) == (
        "<user>hi|unset|unset")
    assert template.render(hi, variables={"continue_final_message": True, "tokenize": False}) == (
        "<user>hi<assistant>|unset|unset")


def test_continuing_a_final_message_the_template_writes_twice_cuts_at_its_last():
    """transformers' apply_chat_template (which vLLM renders with) cuts a continued message's text where its tag last
    appears (rindex): a template that writes the final message twice (a recap after the turns, say) keeps everything
    up to the second. It was cut at the first, dropping the rest of the prompt the template wrote."""
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                            "[recap: {{ messages[-1].content }}]")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) == (
        "<user>hi</user><assistant>The answer is</assistant>[recap: The answer is")


def test_chat_options_of_the_wrong_type_are_refused_naming_them():
    """chat_template_kwargs not a dict failed inside dict() with a ValueError about "dictionary update sequence
    elements" (and a list of pairs was taken as variables), tools given as a string were rendered as a tool, and a
    truthy "no" for add_generation_prompt meant yes: each is a RequestError naming the option."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    hi = [{"role": "user", "content": "hi"}]
    with TPEngine(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20) as engine:
        for kwargs, named in [(dict(chat_template_kwargs="x"), "chat_template_kwargs must be a dict.*got str"),
                              (dict(chat_template_kwargs=[("x", 1)]), "chat_template_kwargs must be a dict.*got list"),
                              (dict(tools="search"), "tools must be a list of tools.*got str"),
                              (dict(tools=["search"]), "tools must be a list of tools.*got a list holding str"),
                              (dict(add_generation_prompt="no"), "add_generation_prompt must be True or False"),
                              (dict(continue_final_message=1), "continue_final_message must be True or False")]:
            with pytest.raises(RequestError, match=named):
                engine.chat(hi, greedy, **kwargs)
        with pytest.raises(RequestError, match="chat_template_kwargs must be a dict"):
            engine.get_tokenizer().codec.render_chat(hi, variables="x")
        assert engine.chat(hi, greedy, chat_template_kwargs={}, tools=None)[0].prompt == engine.render_chat(hi)


def test_an_empty_conversation_is_refused_as_vllms_apply_chat_template_refuses_it():
    """vLLM's LLM.chat hands each conversation to transformers' apply_chat_template, which raises on an empty one
    ("Cannot apply chat template to an empty conversation"; transformers 4 failed on its first message). TPEngine.chat
    rendered the template over no messages, and completed the generation prompt alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    hi = [{"role": "user", "content": "hi"}]
    with TPEngine(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20) as engine:
        for conversations in ([[]], [hi, []]):
            with pytest.raises(RequestError, match="an empty conversation"):
                engine.chat(conversations, greedy)
        with pytest.raises(RequestError, match="an empty conversation"):
            engine.get_tokenizer().apply_chat_template([], tokenize=False)
        assert engine.chat([hi], greedy)[0].prompt == engine.render_chat(hi)


def test_documents_given_as_a_template_variable_reach_the_template():
    """vLLM's LLM.chat has no documents argument: a RAG template's sources go in chat_template_kwargs, which reach
    apply_chat_template's `documents`; its server takes them there too where the request's documents field is unset
    (merge_kwargs keeps a variable the field leaves None). They were refused here ("may not set documents"), though
    no argument of TPEngine.chat sets them."""
    template = ChatTemplate("{% for d in documents or [] %}[{{ d.text }}]{% endfor %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}")
    hi = [{"role": "user", "content": "hi"}]
    assert template.render(hi, variables={"documents": [{"title": "t", "text": "Lima"}]}) == "[Lima]hi"
    assert template.render(hi, variables={"documents": [{"text": "Lima"}]}, documents=[{"text": "Quito"}]) == \
        "[Quito]hi"  # (the request's field, where given)
    assert template.render(hi) == "hi"
    with TPEngine(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20) as engine:
        (out,) = engine.chat(hi, SamplingParams(temperature=0.0, max_tokens=1), chat_template=template.source,
                             chat_template_kwargs={"documents": [{"title": "t", "text": "Lima"}]})
        assert out.prompt == "[Lima]hi"


def test_get_tokenizers_apply_chat_template_gives_documents_to_the_template_as_transformers(hf_tokenizer):
    """transformers' apply_chat_template(documents=...) hands a RAG template its sources, and so does vLLM's
    LLM.get_tokenizer(); the engine's stand-in for it refused them ("takes no documents") though the chat template now
    takes documents, from chat_template_kwargs and the server's documents field."""
    from tpgraph.prompts import EngineTokenizer, PromptCodec
    from tpgraph.tokenizer import builtin_tokenizer

    source = ("{% for d in documents or [] %}[{{ d.text }}]{% endfor %}"
              "{% for m in messages %}{{ m.content }}{% endfor %}")
    codec = PromptCodec(builtin_tokenizer(), ChatTemplate(source), GenerationDefaults(), "m")
    hi, docs = [{"role": "user", "content": "hi"}], [{"title": "Peru", "text": "Lima"}]
    ours = EngineTokenizer(codec).apply_chat_template(hi, documents=docs, tokenize=False)
    assert ours == hf_tokenizer.apply_chat_template(hi, documents=docs, chat_template=source, tokenize=False) == \
        "[Lima]hi"


@pytest.mark.parametrize("source, variables", [
    ("{% for i in range(n) %}{% endfor %}", {"n": 10 ** 8}),  # (the sandbox's range limit: an OverflowError)
    ("{{ total // n }}", {"total": 6, "n": 0}),  # (a ZeroDivisionError)
    ("{{ '{:d}'.format(n) }}", {"n": "x"}),  # (a ValueError)
])
def test_a_template_that_fails_in_any_way_is_the_requests_error(source, variables):
    """vLLM's safe_apply_chat_template turns whatever the template raises into a ValueError (a 400): a template that
    fails on the variables a request gives it (chat_template_kwargs) is the request's error, not the server's (a
    500)."""
    with pytest.raises(RequestError, match="the chat template"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], variables=variables)


@pytest.mark.parametrize("content", ["Lima ", "Lima\n", " Lima", "Lima", "The answer is  "])
def test_continuing_a_message_the_template_trims_cuts_as_hf(ckpt, hf_tokenizer, content):
    """Llama 3's template trims each message: apply_chat_template then leaves out the whitespace at the end of the
    message to continue (the template wrote none); the text kept it ("...Lima " for "...Lima")."""
    messages = [{"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": content}]
    ours = ChatTemplate.from_dir(ckpt, "").render(messages, add_generation_prompt=False, continue_final_message=True)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
    assert ours == theirs and ours.endswith(content.strip())


def named_templates_checkpoint(path):
    """A chat checkpoint whose tokenizer_config.json holds two named templates: "default" and "tool_use"."""
    ckpt = make_chat_checkpoint(path)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | tojson }}{% for m in messages %}<{{ m['content'] }}>{% endfor %}"}]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ckpt


def renders_as_transformers(template, hf) -> tuple[list, list]:
    """The template renders a message with and without tools as transformers' tokenizer does, "tool_use" where tools
    are given; returns (messages, tools)."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"}]
    for kw in ({}, {"tools": tools}):
        assert template.render(messages, **kw) == hf.apply_chat_template(messages, tokenize=False, **kw)
    assert template.render(messages, tools=tools).startswith('[{"type": "function"')
    return messages, tools


def test_a_checkpoints_tool_use_template_renders_where_tools_are_given(tmp_path):
    """A checkpoint with named templates (Hermes 2 Pro, Command R: "default" and "tool_use"): apply_chat_template
    renders "tool_use" where tools are given; the default one was rendered, without the tools."""
    transformers = pytest.importorskip("transformers")
    ckpt = named_templates_checkpoint(tmp_path)
    template = ChatTemplate.from_dir(ckpt, "")
    messages, tools = renders_as_transformers(template, transformers.AutoTokenizer.from_pretrained(str(ckpt)))
    import pickle  # (the server's front end gets it pickled)

    assert pickle.loads(pickle.dumps(template)).render(messages, tools=tools) == template.render(messages, tools=tools)


def test_named_templates_saved_as_jinja_files_are_read_as_transformers_reads_them(tmp_path):
    """transformers saves named templates as chat_template.jinja (the default) and additional_chat_templates/NAME.jinja
    (a Hermes 3 re-saved): "tool_use" renders where tools are given. Only chat_template.jinja was read, so a request
    with tools got the default template, without them."""
    transformers = pytest.importorskip("transformers")
    ckpt = named_templates_checkpoint(tmp_path / "ckpt")
    transformers.AutoTokenizer.from_pretrained(str(ckpt)).save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved"
    assert (saved / "chat_template.jinja").is_file()
    assert (saved / "additional_chat_templates" / "tool_use.jinja").is_file()
    renders_as_transformers(ChatTemplate.from_dir(saved, ""), transformers.AutoTokenizer.from_pretrained(str(saved)))


def test_a_chat_template_from_a_file_or_the_flag_itself(tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    messages = [{"role": "user", "content": "x"}]
    assert ChatTemplate.from_option(str(tmp_path / "t.jinja")).render(messages) == "[x]"
    assert ChatTemplate.from_option("{{ messages[0]['content'] }}!").render(messages) == "x!"
    assert ChatTemplate.from_option(tmp_path / "t.jinja").render(messages) == "[x]"  # (a Path, as model takes one)
    for missing in (str(tmp_path / "missing.jinja"), tmp_path / "missing.jinja"):
        with pytest.raises(CheckpointError, match="neither a file nor a template"):
            ChatTemplate.from_option(missing)
    assert EngineConfig(chat_template=tmp_path / "t.jinja").chat_template == tmp_path / "t.jinja"
    with TPEngine(device="cpu", max_model_len=64, chat_template="<{{ messages[0]['content'] }}>") as engine:
        assert engine.render_chat(messages) == "<x>"


def test_special_tokens_kept_in_special_tokens_map_json_reach_the_template(tmp_path):
    """Older checkpoints keep bos_token and eos_token in special_tokens_map.json, not in tokenizer_config.json:
    transformers reads them from there (a config without added_tokens_decoder), so {{ bos_token }} is BOS."""
    transformers = pytest.importorskip("transformers")
    ckpt = make_chat_checkpoint(tmp_path / "c")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token"):
        config.pop(key)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    (ckpt / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False}, "eos_token": "<|eot_id|>"}))
    messages = CONVERSATIONS[0]
    theirs = transformers.AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(messages, tokenize=False,
                                                                                      add_generation_prompt=True)
    assert theirs.startswith("<|begin_of_text|>")
    assert ChatTemplate.from_dir(ckpt, "").render(messages) == theirs
    assert special_tokens(tokenizer_config(ckpt)) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


@pytest.mark.parametrize(("text", "match"), [(b"[1]", "holds a JSON list"), (b"\xff{", "cannot read"),
                                             (b'{"eos_token_id": ["</s>"]}', "eos_token_id must be"),
                                             (b'{"eos_token_id": [2, null]}', "eos_token_id must be"),
                                             (b'{"eos_token_id": "2"}', "eos_token_id must be")])
def test_a_generation_config_of_the_wrong_shape_is_named(tmp_path, text, match):
    """(a list, bytes that are no text, or EOS ids that are no integers: the last failed the engine's start with a
    TypeError comparing them, or a string id was silently never matched)"""
    (tmp_path / "generation_config.json").write_bytes(text)
    with pytest.raises(CheckpointError, match=f"generation_config.json.*{match}|{match}.*generation_config.json"):
        GenerationDefaults.from_dir(tmp_path)


@pytest.mark.parametrize("field", ['"top_p": 0', '"temperature": -1', '"repetition_penalty": 0', '"min_p": 2'])
def test_a_generation_config_default_out_of_range_is_named_at_start(tmp_path, field):
    """Requests take these as their defaults: one out of range was accepted at start, and then every request that left
    the field unset was refused with a 400 ("top_p must be in (0, 1]") naming a field its client never sent."""
    (tmp_path / "generation_config.json").write_text(f"{{{field}}}")
    name = field.split('"')[1]
    with pytest.raises(CheckpointError, match=f"generation_config.json: {name} must be in"):
        GenerationDefaults.from_dir(tmp_path)


@pytest.mark.parametrize("top_k", ["NaN", "Infinity", "1e999"])
def test_a_generation_config_top_k_that_is_no_number_of_tokens_is_named_at_start(tmp_path, top_k):
    """The start-up check took top_k through int(), which raises on NaN and infinity (json reads both): a ValueError or
    OverflowError traceback from the engine's start, where the check was to name the field."""
    (tmp_path / "generation_config.json").write_text(f'{{"top_k": {top_k}}}')
    with pytest.raises(CheckpointError, match="generation_config.json: top_k must be an integer"):
        GenerationDefaults.from_dir(tmp_path)


def test_a_generation_config_top_k_written_as_a_float_is_a_default_the_engine_takes(tmp_path):
    """top_k 50.0 passed the start-up check (taken through int(), as the server takes it) but was kept a float, so
    TPEngine.default_params() and generate/chat without parameters refused it: "top_k must be an integer, got 50.0"."""
    from tpgraph.engine.sampling_params import SamplingParams

    (tmp_path / "generation_config.json").write_text('{"top_k": 50.0, "temperature": 0.7}')
    sampling = GenerationDefaults.from_dir(tmp_path).sampling
    assert sampling == {"top_k": 50, "temperature": 0.7} and SamplingParams(**sampling).top_k == 50


def test_checkpoint_json_is_read_as_utf_8_whatever_the_locale(tmp_path):
    """JSON is UTF-8 (transformers reads it so); read in the locale's encoding, a non-ASCII special token (DeepSeek's
    <｜begin▁of▁sentence｜>) failed to load under an ASCII locale, or became mojibake under a Latin-1 one."""
    import os
    import subprocess
    import sys

    bos = "<｜begin▁of▁sentence｜>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos}, ensure_ascii=False),
                                                    encoding="utf-8")
    import tpgraph

    root = os.path.dirname(os.path.dirname(tpgraph.__file__))
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    code = ("import sys; from tpgraph.chat import tokenizer_config; "
            "sys.stdout.buffer.write(tokenizer_config(sys.argv[1])['bos_token'].encode('utf-8'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert out.returncode == 0 and out.stdout.decode("utf-8") == bos, out.stderr.decode(errors="replace")[-500:]


# --- the chat templates Llama checkpoints are served with, rendered as vLLM renders them (through transformers) ---

TEMPLATES = Path(__file__).parent / "chat_templates"
# vLLM's chat_template_content_format "auto" for each (its detection: a template that loops over a message's content
# gets each message's content as a list of {"type": "text", "text": ...} parts; any other gets one string)
OPENAI_FORMAT = {"vllm_tool_chat_template_llama3.1_json", "vllm_tool_chat_template_llama3.2_json"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string", "description": "the city"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ASKED = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
# what clients send, each with the request's other fields (tools, add_generation_prompt, ...)
CHATS = {
    "user": {"messages": [{"role": "user", "content": "Hi there"}]},
    "turns": {"messages": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": " Peru? "},
                           {"role": "assistant", "content": "Lima"}, {"role": "user", "content": "Chile — ¿ñ? 你好"}]},
    "no_prompt": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                  "add_generation_prompt": False},
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, NOW]},
    "tools_system": {"messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Paris?"}],
                     "tools": [WEATHER]},
    "tools_empty": {"messages": [{"role": "user", "content": "Hi"}], "tools": []},
    "tool_result": {"messages": [*ASKED, {"role": "tool", "tool_call_id": "call_1", "content": "22C, sunny"}],
                    "tools": [WEATHER]},
    "tool_result_json": {"messages": [{"role": "user", "content": "Weather?"},
                                      {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 22}'},
                                      {"role": "user", "content": "Thanks"}], "tools": [WEATHER]},
    "tool_result_parts": {"messages": [*ASKED, {"role": "tool", "tool_call_id": "call_1", "content": [
        {"type": "text", "text": "22C"}, {"type": "text", "text": "sunny"}]}], "tools": [WEATHER]},
    "tool_result_null": {"messages": [*ASKED, {"role": "tool", "tool_call_id": "call_1", "content": None}],
                         "tools": [WEATHER]},
    "continued": {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}],
                  "add_generation_prompt": False, "continue_final_message": True},
    "tools_in_system": {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER],
                        "chat_template_kwargs": {"tools_in_user_message": False}},
    "tools_in_user": {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER],
                      "chat_template_kwargs": {"tools_in_user_message": True}},
    "builtin_tools": {"messages": [{"role": "user", "content": "Search"}],
                      "chat_template_kwargs": {"builtin_tools": ["brave_search", "wolfram_alpha"]}},
    "named": {"messages": [{"role": "user", "content": "Hi", "name": "bob"}]},
    "null_calls": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello",
                                                                    "tool_calls": None},
                                {"role": "user", "content": "Bye"}]},
    "reasoning": {"messages": [{"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "<think>x</think>Hello", "reasoning": "x"},
                               {"role": "user", "content": "Bye"}]},
    "null_reply": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                                {"role": "user", "content": "Bye"}]},
    "empty": {"messages": [{"role": "user", "content": ""}]},
}


def vllm_conversation(messages: list[dict], openai_format: bool) -> list[dict]:
    """The messages as vLLM hands them to apply_chat_template (chat_utils' _parse_chat_message_content and
    _postprocess_messages): content as a list of text parts ("openai") or their texts joined by newlines; an
    assistant's tool calls (where not null or empty) with their arguments parsed; a tool message's parts joined; a
    name."""
    out = []
    for m in messages:
        content = m.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else [
            {"type": "text", "text": p if isinstance(p, str) else p["text"]} for p in content]
        msg = {"role": m["role"], "content": parts if openai_format else "\n".join(p["text"] for p in parts)}
        if m["role"] == "assistant" and m.get("tool_calls"):  # (null dropped, and [] by _postprocess_messages)
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"] or "{}")}} for c in m["tool_calls"]]
        if m["role"] == "assistant" and m.get("reasoning") is not None:
            msg.update(reasoning=m["reasoning"], reasoning_content=m["reasoning"])
        if m["role"] == "tool":
            msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def vllm_tools(tools: list[dict] | None) -> list[dict] | None:
    """The tools as vLLM dumps its pydantic models for the template: type, then name, description, parameters."""
    return None if tools is None else [{"type": "function", "function": {
        "name": t["function"]["name"], "description": t["function"].get("description"),
        "parameters": t["function"].get("parameters")}} for t in tools]


def vllm_render(hf_tokenizer, name: str, body: dict) -> str:
    """What vLLM's chat route renders for a request with the template `name` (dated, so the day does not matter)."""
    kwargs = {"date_string": "26 Jul 2024", **body.get("chat_template_kwargs", {})}
    return hf_tokenizer.apply_chat_template(
        vllm_conversation(body["messages"], name in OPENAI_FORMAT), tools=vllm_tools(body.get("tools")),
        chat_template=(TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False), **kwargs)


def served_tokens(ckpt, name: str, bodies: list[dict]) -> list:
    """/tokenize's answers (the chat route's rendering, encoded) for each request, from a server with `name` as its
    chat template (--chat-template)."""
    pytest.importorskip("fastapi")
    import asyncio

    from tpgtest.server_stubs import IdleClient, httpx_module

    from tpgraph.prompts import PromptCodec
    from tpgraph.server import app as server_app
    from tpgraph.server.metrics import ServerMetrics
    from tpgraph.tokenizer import load_tokenizer

    template = ChatTemplate.from_option(TEMPLATES / f"{name}.jinja", special_tokens(tokenizer_config(ckpt)))
    codec = PromptCodec(load_tokenizer(str(ckpt), 320), template, GenerationDefaults(), "m", (EOT_ID,))
    app = server_app.create_app(IdleClient(), codec, ServerMetrics(), "m", 4096)

    async def send() -> list:
        httpx = httpx_module()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [await http.post("/tokenize", json={
                **body, "chat_template_kwargs": {"date_string": "26 Jul 2024", **body.get("chat_template_kwargs", {})}})
                for body in bodies]

    return asyncio.run(send())


def parity(ckpt, hf_tokenizer, name: str, chats: dict[str, dict]) -> dict[str, tuple]:
    """The chats whose served prompt is not vLLM's: name -> (served, vLLM's), each the text or the error."""
    differ = {}
    for (chat, body), reply in zip(chats.items(), served_tokens(ckpt, name, list(chats.values())), strict=True):
        try:
            theirs = vllm_render(hf_tokenizer, name, body)
        except Exception as exc:  # (vLLM answers 400: the template refuses the chat)
            theirs = f"refused: {type(exc).__name__}"
        ours = hf_tokenizer.decode(reply.json()["tokens"]) if reply.status_code == 200 else "refused"
        if ours != theirs and not (ours == "refused" and theirs.startswith("refused")):
            differ[chat] = (ours, theirs)
    return differ


@pytest.mark.parametrize("name", sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
def test_real_llama_templates_render_each_chat_as_vllm_does(ckpt, hf_tokenizer, name):
    """Llama 3.1/3.2/3.3 Instruct's templates, vLLM's Llama tool templates (JSON and pythonic), DeepSeek-R1's Llama
    distillation's and Hermes 3's tool_use one: what a client sends renders, through the server (/tokenize, which
    renders as the chat route does), to vLLM's prompt (its message handling, then transformers' apply_chat_template),
    or is refused where vLLM refuses it."""
    assert parity(ckpt, hf_tokenizer, name, CHATS) == {}


@pytest.mark.parametrize("name", ["llama3.1_instruct", "vllm_tool_chat_template_llama3.1_json",
                                  "vllm_tool_chat_template_llama3.2_pythonic", "hermes3_llama3.1_tool_use"])
def test_an_assistant_message_with_an_empty_tool_calls_list_renders_as_plain_text(ckpt, hf_tokenizer, name):
    """tool_calls [] (a client that always sends the field): vLLM's _postprocess_messages drops it ("to keep templates
    on the normal assistant path", vLLM PR #30648), so the turn renders as the assistant's text. 756dfe0 handed the
    template the empty list: Llama 3.1's refused the chat, vLLM's JSON one wrote "No tool calls found.", the pythonic
    one "[]"."""
    chat = {"messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello", "tool_calls": []},
                         {"role": "user", "content": "Bye"}], "tools": [WEATHER]}
    assert parity(ckpt, hf_tokenizer, name, {"empty_calls": chat}) == {}
    plain = {**chat, "messages": [{k: v for k, v in m.items() if k != "tool_calls"} for m in chat["messages"]]}
    ours = [r.json()["tokens"] for r in served_tokens(ckpt, name, [chat, plain])]
    assert ours[0] == ours[1]


PARTS = [{"type": "text", "text": "Describe "}, {"type": "text", "text": " this"}]


@pytest.mark.parametrize("name", sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
def test_content_parts_reach_a_template_that_loops_over_them_as_a_list(ckpt, hf_tokenizer, name):
    """vLLM's content format "auto": a template that loops over a message's content (its llama3.1_json and
    llama3.2_json tool templates) gets each message's content as a list of {"type": "text"} parts, a string content
    as one part; they each trim a part, and take the system message's first part only. The parts were joined into one
    string for every template, so "Describe " and " this" rendered "Describe \\n this" where vLLM renders
    "Describethis", and a system message of parts A, B rendered "A\\nB" where vLLM renders "A"."""
    chats = {"parts": {"messages": [{"role": "user", "content": PARTS}]},
             "system_parts": {"messages": [{"role": "system", "content": [{"type": "text", "text": "A"}, "B"]},
                                           {"role": "user", "content": "hi"}]},
             "tools_parts": {"messages": [{"role": "user", "content": PARTS}], "tools": [WEATHER],
                             "chat_template_kwargs": {"tools_in_user_message": True}},
             "continued_parts": {"messages": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": [
                 {"type": "text", "text": "It is"}, {"type": "text", "text": " a cat "}]}],
                                 "add_generation_prompt": False, "continue_final_message": True}}
    assert parity(ckpt, hf_tokenizer, name, chats) == {}
    expected = "openai" if name in OPENAI_FORMAT else "string"
    assert ChatTemplate.from_option(TEMPLATES / f"{name}.jinja").content_format() == expected
