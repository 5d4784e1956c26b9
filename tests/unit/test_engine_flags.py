"""vLLM's engine flags beyond the core ones, each doing what vLLM's does (or refused where it cannot): --tokenizer,
--tokenizer-mode."""

from __future__ import annotations

import json

import pytest
from tokenizers import processors

from tpgraph.engine.cli import engine_kwargs
from tpgraph.engine.tp_engine import TPEngine
from tpgraph.errors import ConfigError
from tpgraph.serve import parse_args
from tpgraph.tokenizer import builtin_tokenizer

SMALL = dict(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20)


def tokenizer_dir(path, template: str = "T:{{ messages[0]['content'] }}"):
    """The built-in byte tokenizer, but adding no BOS, with a template and special tokens of its own."""
    path.mkdir()
    tok = builtin_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<B>"}))
    return path


def test_a_separate_tokenizer_directory_tokenizes_and_renders_chats(tmp_path):
    """vLLM's --tokenizer: the tokenizer, its special tokens and its chat template come from that directory."""
    tok = tokenizer_dir(tmp_path / "tok", "{{ bos_token }}T:{{ messages[0]['content'] }}")
    kwargs = engine_kwargs(parse_args(["--tokenizer", str(tok), "--device", "cpu"]))
    assert kwargs["tokenizer"] == str(tok)
    with TPEngine(**{**SMALL, "tokenizer": kwargs["tokenizer"]}) as engine:
        assert engine.encode("hi") == [104, 105]  # (the built-in tokenizer adds BOS, 256, first)
        assert engine.render_chat([{"role": "user", "content": "x"}]) == "<B>T:x"
    with TPEngine(**SMALL) as engine:
        assert engine.encode("hi") == [256, 104, 105]


def test_a_tokenizer_directory_without_tokenizer_json_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        TPEngine(**SMALL, tokenizer=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        TPEngine(**SMALL, tokenizer=tmp_path / "empty")


@pytest.mark.parametrize("mode", ["auto", "hf"])
def test_the_fast_tokenizer_modes_are_taken(mode):
    assert parse_args(["--tokenizer-mode", mode]).tokenizer_mode == mode


@pytest.mark.parametrize("mode", ["slow", "mistral", "custom"])
def test_tokenizer_modes_this_engine_cannot_run_are_refused_naming_the_flag(mode, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--tokenizer-mode", mode])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--tokenizer-mode" in err and f"'{mode}' is not supported" in err
    assert "'auto' or 'hf'" in err


def test_max_logprobs_refuses_requests_asking_more_and_takes_those_within():
    """vLLM's --max-logprobs (20 by default): a request asking more alternatives a token, for its output or its
    prompt, is refused (a 400 from the server, whose front end checks the same limits); the engine still warms up."""
    from tpgraph.engine.sampling_params import SamplingParams
    from tpgraph.errors import RequestError

    assert engine_kwargs(parse_args([]))["max_logprobs"] == 20
    kwargs = engine_kwargs(parse_args(["--max-logprobs", "1"]))
    with TPEngine(**{**SMALL, "max_logprobs": kwargs["max_logprobs"]}) as engine:
        engine.warm_up()
        (out,) = engine.generate("ab", SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1))
        assert [len(top) for top in out.outputs[0].top_logprobs] == [1, 1]
        for asked in (dict(logprobs=2), dict(prompt_logprobs=5)):
            with pytest.raises(RequestError, match=r"more than the 1 this server returns \(its max_logprobs\)"):
                engine.generate("ab", SamplingParams(max_tokens=2, **asked))
        assert engine.core.limits.max_logprobs == 1  # (the front end's copy of the checks)


@pytest.mark.parametrize("value", ["-1", "21"])
def test_a_max_logprobs_the_sampler_cannot_return_is_refused_when_parsed(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--max-logprobs", value])
    assert "argument --max-logprobs: must be 0 to 20" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_logprobs must be an integer from 0 to 20"):
        TPEngine(**SMALL, max_logprobs=int(value))
