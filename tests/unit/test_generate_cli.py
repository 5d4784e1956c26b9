"""`python -m tpgraph.generate`, the offline command-line generator, as a new user runs it (in-process through main)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.tp_engine import TPEngine
from tpgraph.generate import main, parse_args

SMALL = ["--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "64", "--num-kv-blocks", "20"]


@pytest.fixture
def seen_params(monkeypatch) -> list[SamplingParams]:
    """The SamplingParams main passes to TPEngine.generate, each call's."""
    seen: list[SamplingParams] = []
    real = TPEngine.generate

    def spy(self, prompts, sampling_params=None, *args, **kwargs):
        seen.append(sampling_params)
        return real(self, prompts, sampling_params, *args, **kwargs)

    monkeypatch.setattr(TPEngine, "generate", spy)
    return seen


def test_the_checkpoints_generation_defaults_and_overrides_reach_the_prompts(seen_params, capsys):
    """--generation-config / --override-generation-config were taken and ignored: every sampling flag had a default of
    its own (greedy, 32 tokens), so the checkpoint's generation_config.json and the overrides changed nothing. Flags
    left out now take the engine's defaults (as the server's requests do); flags given win."""
    assert main(["--prompt", "hi", *SMALL, "--override-generation-config",
                 '{"temperature": 0.9, "top_k": 5, "max_new_tokens": 3}']) == 0
    (params,) = seen_params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 5, 3)
    assert "3 tokens in" in capsys.readouterr().out

    assert main(["--prompt", "hi", *SMALL, "--override-generation-config", '{"temperature": 0.9, "top_k": 5}',
                 "--temperature", "0", "--max-tokens", "2"]) == 0
    params = seen_params[-1]
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 5, 2)


def test_without_generation_defaults_the_flags_defaults_hold(seen_params):
    """No generation_config: greedy, 32 tokens, as before."""
    assert main(["--prompt", "hi", *SMALL, "--generation-config", "vllm"]) == 0
    (params,) = seen_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (0.0, 1.0, 0, 0.0, 32)


def test_a_sampling_flag_out_of_range_is_refused_before_the_engine_starts(monkeypatch, capsys):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr("tpgraph.generate.engine_from_args", no_engine)
    assert main(["--prompt", "hi", *SMALL, "--top-p", "2"]) == 2
    assert "--top-p must be in (0.0, 1.0]" in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--max-tokens", "0"], "error: --max-tokens must be >= 1, got 0"),
    (["--top-k", "-5"], "error: --top-k must be >= 0, got -5"),
    (["--min-p", "3"], "error: --min-p must be in [0.0, 1.0], got 3.0"),
    (["--temperature", "nan"], "error: --temperature must be a finite number, got nan"),
])
def test_a_sampling_flag_out_of_range_is_refused_naming_the_flag(flags, needle, capsys):
    """The refusal named SamplingParams' field (max_tokens must be >= 1), not the flag typed."""
    assert main(["--prompt", "hi", *SMALL, *flags]) == 2
    assert needle in capsys.readouterr().err


def run_generate(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """A fresh process: logging is configured once a process, and pytest's own handlers sit on this one's root."""
    return subprocess.run([sys.executable, "-m", "tpgraph.generate", "--prompt", "hi", "--max-tokens", "1", *SMALL,
                           *flags], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_vllms_logging_variables_are_honoured_as_the_server_honours_them(tmp_path):
    """tpgraph.generate set up its own logging whatever VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING,
    VLLM_LOGGING_PREFIX, VLLM_LOGGING_STREAM and VLLM_LOGGING_CONFIG_PATH said (vLLM's offline LLM reads them
    as its server does): a bad value ran on, and stream, prefix, level and configuration files were ignored."""
    bad = run_generate({"VLLM_LOGGING_LEVEL": "LOUD"})
    assert bad.returncode == 2 and "VLLM_LOGGING_LEVEL='LOUD' is no logging level" in bad.stderr

    moved = run_generate({"VLLM_LOGGING_STREAM": "ext://sys.stdout", "VLLM_LOGGING_PREFIX": "[gen] "})
    assert moved.returncode == 0, moved.stderr
    assert "[gen] INFO tpgraph.engine.runner: start-up summary" in moved.stdout
    assert "start-up summary" not in moved.stderr

    quiet = run_generate({"VLLM_LOGGING_LEVEL": "warning"})
    assert quiet.returncode == 0 and "start-up summary" not in quiet.stderr + quiet.stdout

    off = run_generate({"VLLM_CONFIGURE_LOGGING": "0"})
    assert off.returncode == 0 and "INFO tpgraph" not in off.stderr + off.stdout

    log = tmp_path / "gen.log"
    config = {"version": 1, "formatters": {"f": {"format": "FILE %(name)s %(message)s"}},
              "handlers": {"h": {"class": "logging.FileHandler", "filename": str(log), "formatter": "f"}},
              "loggers": {"vllm": {"handlers": ["h"], "level": "INFO"}}}
    (tmp_path / "log.json").write_text(json.dumps(config))
    filed = run_generate({"VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "log.json")})
    assert filed.returncode == 0, filed.stderr
    assert "FILE tpgraph.engine.runner start-up summary" in log.read_text()


def test_flag_names_written_with_underscores_are_taken_as_the_servers_are():
    """`--max_num_seqs=4` (vLLM's parsers, the offline examples' too, take either spelling of a flag's name) was an
    unrecognized argument here, though the README gives this command the server's flags, which take it."""
    args = parse_args(["--prompt", "a_b", "--max_num_seqs=4", "--max_tokens", "3", "--enable_prefix_caching"])
    assert (args.max_num_seqs, args.max_tokens, args.enable_prefix_caching, args.prompt) == (4, 3, True, ["a_b"])


def test_ctrl_c_stops_with_a_line_and_exit_status_130_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C while generating ended in a KeyboardInterrupt traceback; the server stops on it with a line. The engine
    is still closed on the way out (its ranks with it)."""
    closed = []
    real_close = TPEngine.close

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    def close(self, *args, **kwargs):
        closed.append(True)
        real_close(self, *args, **kwargs)

    monkeypatch.setattr(TPEngine, "generate", interrupted)
    monkeypatch.setattr(TPEngine, "close", close)
    try:
        status = main(["--prompt", "hi", *SMALL])
    except KeyboardInterrupt:  # (failed here, not as the test session's own interruption)
        pytest.fail("main let the KeyboardInterrupt out: a traceback")
    assert status == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")
    assert closed


def test_ctrl_c_while_the_engine_starts_stops_with_a_line_too(monkeypatch, capsys):
    def loading(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("tpgraph.generate.engine_from_args", loading)
    try:
        status = main(["--prompt", "hi", *SMALL])
    except KeyboardInterrupt:
        pytest.fail("main let the KeyboardInterrupt out: a traceback")
    assert status == 130 and capsys.readouterr().err.strip() == "interrupted"


def test_chat_renders_each_prompt_as_a_user_turn_through_the_chat_template(capsys):
    """--chat-template was taken and ignored: every prompt went to the model as plain text, with no way to ask for
    the chat template. --chat sends each prompt as one user message through it (the checkpoint's, or
    --chat-template's), as vLLM's LLM.chat; --chat-template without --chat is refused rather than ignored."""
    assert main(["--prompt", "hi", "--chat", "--chat-template", "T:{{ messages[0]['content'] }}", *SMALL,
                 "--max-tokens", "2"]) == 0
    assert "prompt: 'T:hi'" in capsys.readouterr().out
    assert main(["--prompt", "hi", "--chat", *SMALL, "--max-tokens", "2"]) == 0  # (the built-in template)
    assert "prompt: 'hi'" not in capsys.readouterr().out

    with pytest.raises(SystemExit) as refused:
        parse_args(["--prompt", "hi", "--chat-template", "T:{{ messages[0]['content'] }}"])
    assert refused.value.code == 2
    assert "--chat-template renders chats: add --chat" in capsys.readouterr().err


def test_a_tp_size_that_is_not_torchruns_world_size_names_the_flag(monkeypatch, capsys):
    """`torchrun --nproc-per-node 2 -m tpgraph.generate -tp 1` was refused as "tp_size=1 but 2 ranks were launched",
    TPEngine's keyword, not the flag typed."""
    monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun --nproc-per-node 1
    monkeypatch.setenv("RANK", "0")
    assert main(["--prompt", "hi", *SMALL, "-tp", "2"]) == 2
    assert "error: --tensor-parallel-size/-tp=2 but 1 ranks were launched" in capsys.readouterr().err
