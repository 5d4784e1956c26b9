"""The server's and the engine's flags: values that can only fail later (after minutes of loading, or as a spinning
loop) are refused when parsed."""

import re

import pytest

from tpgraph.engine.cli import engine_kwargs
from tpgraph.errors import ConfigError
from tpgraph.serve import parse_args


@pytest.mark.parametrize("flags,needle", [
    (["--port", "0"], "a port is 1-65535"), (["--port", "70000"], "a port is 1-65535"),
    (["--heartbeat-s", "0"], "must be a positive number"), (["--heartbeat-s", "-1"], "must be a positive number"),
    (["--heartbeat-s", "inf"], "must be a positive number"),
    # (an idle torchrun server's other ranks wait for rank 0's next message: past the process group's 600 s timeout,
    # they failed, and the whole server with them)
    (["--heartbeat-s", "900"], "must be at most 300 s, got 900: the other ranks wait for rank 0's next message at "
                               "most 600 s"),
    (["--gpu-memory-utilization", "0"], "must be in (0, 1]"), (["--gpu-memory-utilization", "1.5"], "must be in"),
    (["--gpu-memory-utilization", "nan"], "must be in"),
    (["--api-key", ""], "the API key is empty"), (["--api-key", "  "], "the API key is empty"),
    # (`--served-model-name "$UNSET"` served the model as "", and every request that named it was a 404)
    (["--served-model-name", ""], "argument --served-model-name: is empty (an unset variable?)"),
    (["--served-model-name", "llama", " "], "argument --served-model-name: is empty (an unset variable?)"),
])
def test_bad_values_are_refused_when_parsed(flags, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_good_values_parse():
    args = parse_args(["--port", "65535", "--heartbeat-s", "0.25", "--gpu-memory-utilization", "1"])
    assert (args.port, args.heartbeat_s, args.gpu_memory_utilization) == (65535, 0.25, 1.0)
    assert parse_args(["--heartbeat-s", "300"]).heartbeat_s == 300.0
    assert engine_kwargs(parse_args(["--num-kv-blocks", "60"]))["num_kv_blocks"] == 60  # (preemption on a CPU server)
    assert engine_kwargs(args)["num_kv_blocks"] is None
    assert engine_kwargs(args)["enable_prefix_caching"] is True
    assert engine_kwargs(parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False


@pytest.mark.parametrize("name", ["enable_prefix_caching", "enable_chunked_prefill"])
def test_vllms_on_and_off_spellings_both_parse(name):
    """vLLM takes --enable-prefix-caching / --no-enable-prefix-caching (and the same for chunked prefill): a vLLM
    command line that spells out the default was refused here as an unrecognized argument."""
    flag = "--" + name.replace("_", "-")
    assert engine_kwargs(parse_args([flag]))[name] is True
    assert engine_kwargs(parse_args(["--no-" + flag[2:]]))[name] is False
    assert engine_kwargs(parse_args([]))[name] is True


def test_a_gpu_memory_utilization_given_as_text_is_refused_saying_so():
    """gpu_memory_utilization="0.9" was refused as "must be in (0, 1], got 0.9": a value in that range, by the
    message; the refusal now shows the text as given and asks for a number."""
    from tpgraph.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be a number in \(0, 1\], got '0.9'"):
        EngineConfig(gpu_memory_utilization="0.9")


def test_tp_zero_is_passed_on_to_be_refused_not_taken_as_the_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert engine_kwargs(parse_args(["-tp", "0"]))["tp_size"] == 0
    assert engine_kwargs(parse_args([]))["tp_size"] == 2


@pytest.mark.parametrize("kw,needle", [
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be a number in"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization must be a number in"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128},
     "without chunked prefill, max_num_batched_tokens"),
    ({"tp_size": 0}, "tp_size must be a positive integer"),
    ({"block_size": 24}, "block_size must be a power of two"),  # (refused by the runner, once the weights had loaded)
    ({"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False"),
    # (these were a truthy string run as True, or a TypeError from pathlib or torch.manual_seed after ranks started)
    ({"enable_chunked_prefill": "no"}, "enable_chunked_prefill must be True or False"),
    ({"seed": "1"}, "seed must be an integer"), ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": 2 ** 64}, "seed must be an integer of 64 bits"),
    ({"model": 5}, "model must be a checkpoint directory"), ({"chat_template": 5}, "chat_template must be"),
    ({"dtype": "float64"}, "unknown dtype 'float64'"), ({"load_format": "pt"}, "load_format must be one of"),
])
def test_engine_settings_are_refused_before_anything_loads(kw, needle):
    """EngineConfig refuses them as it is made: TPEngine makes it first, before the weights and any rank."""
    from tpgraph import ConfigError
    from tpgraph.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**kw)
    assert EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128)


def test_the_api_key_comes_from_the_flag_or_else_the_environment(monkeypatch):
    monkeypatch.delenv("TPGRAPH_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_args([]).api_key is None
    monkeypatch.setenv("TPGRAPH_API_KEY", "from-env")
    assert parse_args([]).api_key == ["from-env"] and parse_args(["--api-key", "flag"]).api_key == ["flag"]
    monkeypatch.setenv("TPGRAPH_API_KEY", "")
    assert parse_args([]).api_key is None  # (set but empty: no key, not a key of "")


def test_vllms_api_key_variable_is_not_silently_ignored(monkeypatch, capsys):
    """vLLM's server asks for VLLM_API_KEY where --api-key is not given: a deployment that keeps its key there (a
    secret mounted as that variable) served every route here with no key at all."""
    monkeypatch.delenv("TPGRAPH_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    assert parse_args([]).api_key == ["vk"] and parse_args(["--api-key", "flag"]).api_key == ["flag"]
    monkeypatch.setenv("TPGRAPH_API_KEY", "tk")
    assert parse_args([]).api_key == ["tk"]  # (tpgraph's own variable first)
    monkeypatch.delenv("TPGRAPH_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert parse_args([]).api_key is None  # (set but empty: no key, as vLLM's)
    monkeypatch.setenv("VLLM_API_KEY", " ")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "VLLM_API_KEY is blank" in capsys.readouterr().err


def test_a_blank_key_in_the_environment_is_blamed_on_the_variable(monkeypatch, capsys):
    """TPGRAPH_API_KEY=" " went through --api-key's check as its default: "argument --api-key: ... leave --api-key
    out", to a user who had left it out; the variable is what to fix."""
    monkeypatch.setenv("TPGRAPH_API_KEY", "  ")
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "TPGRAPH_API_KEY is blank" in err and "--api-key" not in err.splitlines()[-1]
    assert parse_args(["--api-key", "flag"]).api_key == ["flag"]  # (the flag wins over the variable, as before)


@pytest.mark.parametrize("key", ["s3cret\n", " s3cret", "s3cret ", "s3\x01cret"])
def test_a_key_no_client_can_send_is_refused_naming_where_it_came_from(key, monkeypatch, capsys):
    """HTTP strips a header value's surrounding whitespace and carries no line break or control character, so a key
    with one (a secret file's trailing newline, in the variable or through $(cat file)) was never matched: the server
    came up and answered every request 401."""
    monkeypatch.delenv("TPGRAPH_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--api-key", key])
    assert exit_.value.code == 2 and "argument --api-key" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_API_KEY", key)
    with pytest.raises(SystemExit):
        parse_args([])
    err = capsys.readouterr().err
    assert "VLLM_API_KEY" in err and "no client can send" in err
    assert parse_args(["--api-key", "two words"]).api_key == ["two words"]  # (a space inside is sent as it is)


@pytest.mark.parametrize("argv", [["--model", ""], [""], ["--model=  "], ["--tokenizer", ""]])
def test_an_empty_model_is_refused_when_parsed(argv, capsys):
    """`--model "$MODEL"` with the variable unset gave the path "", which is the working directory: the engine loaded
    whatever checkpoint it held (else failed naming '.', not what was typed), and replies named the built-in model."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "is empty" in capsys.readouterr().err


def test_a_config_files_empty_model_is_refused_when_parsed(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text('model: ""\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    assert "is empty" in capsys.readouterr().err


def test_a_server_whose_engine_failed_exits_1_also_where_closing_the_engine_hangs(monkeypatch):
    """Rank 0's engine loop failed: the server stops with exit code 1. Closing the engine after a failed step may
    hang (a peer waits in the step's collectives); the close's time limit then ended the process with os._exit(0),
    so a failed server exited as if stopped cleanly (to a supervisor: nothing to restart)."""
    import os
    import signal
    import socket
    import threading
    from types import SimpleNamespace

    from tpgraph import serve
    from tpgraph.engine import service, tp_engine
    from tpgraph.server import bridge, frontend, metrics

    stuck = threading.Event()

    class Engine:
        def __init__(self, **_) -> None:
            self.tokenizer, self.prompts = None, None
            self.state = SimpleNamespace(rank=0, world_size=1)
            self.core, self.runner = SimpleNamespace(limits=None), SimpleNamespace(max_model_len=128)
            self.service = None  # (torchrun's ranks: the server makes its own loop)

        def warm_up(self) -> None:
            pass

        def close(self, followers_told: bool = False) -> None:
            stuck.wait(30)

    class FailedService:
        alive, error = False, RuntimeError("a step failed")

        def __init__(self, *_, **__) -> None:
            pass

        def start(self) -> None:
            pass

        def shutdown(self, timeout_s: float) -> bool:
            return False  # (its loop had ended: no rank was told)

    class Bridge:
        def __init__(self, *_, **__) -> None:
            self.start = self.close = lambda: None
            self.compiling = lambda: 0

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    front = SimpleNamespace(is_alive=lambda: True, join=lambda *_: None, exitcode=None, terminate=lambda: None)
    monkeypatch.setattr(tp_engine, "TPEngine", Engine)
    monkeypatch.setattr(service, "EngineService", FailedService)
    monkeypatch.setattr(metrics, "EngineMetrics", lambda core, name, cache: SimpleNamespace(
        exposition=lambda: b"", prompt_tokens=0, generated_tokens=0))
    monkeypatch.setattr(metrics, "cache_config_info", lambda core: {})
    monkeypatch.setattr(frontend, "start_frontends", lambda spec, sockets, scratch: [(front, None)])
    monkeypatch.setattr(bridge, "EngineBridge", Bridge)
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.delenv("RANK", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        with pytest.raises(SystemExit) as exit_:
            serve.main(["--device", "cpu", "--port", str(port)])
    finally:
        stuck.set()
    assert exit_.value.code == 1


def test_a_follower_whose_loop_failed_exits_1_also_where_closing_the_engine_hangs(monkeypatch):
    """A follower (rank > 0) whose engine loop raised: closing the engine may then hang (a peer is gone), and the
    close's time limit ended the process with os._exit(0), a failed rank exiting as if stopped cleanly."""
    import os
    import signal
    import threading
    from types import SimpleNamespace

    from tpgraph import serve
    from tpgraph.engine import service, tp_engine

    stuck = threading.Event()

    class Engine:
        def __init__(self, **_) -> None:
            self.tokenizer, self.prompts = None, None
            self.state = SimpleNamespace(rank=1, world_size=2)
            self.core = None

        def warm_up(self) -> None:
            pass

        def close(self, followers_told: bool = False) -> None:
            stuck.wait(30)

    class FailedService:
        def __init__(self, *_, **__) -> None:
            pass

        def run_worker(self) -> None:
            raise RuntimeError("a step failed")

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(tp_engine, "TPEngine", Engine)
    monkeypatch.setattr(service, "EngineService", FailedService)
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setenv("RANK", "1")
    close = serve._close
    monkeypatch.setattr(serve, "_close", lambda engine, **kw: close(engine, **{**kw, "timeout_s": 0.2}))
    try:
        with pytest.raises(SystemExit) as exit_:
            serve.main(["--device", "cpu"])
    finally:
        stuck.set()
    assert exit_.value.code == 1


def test_torchruns_variables_that_are_not_integers_are_named_not_a_traceback(monkeypatch, capsys):
    """WORLD_SIZE (read for the default TP size) and RANK (whether this rank checks the port) went through int(): a
    ValueError traceback from `tpgraph.serve` / `tpgraph.generate`, which print a TPGraphError as one line."""
    from tpgraph import ConfigError
    from tpgraph.serve import main

    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        engine_kwargs(parse_args([]))
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "zero")
    assert main([]) == 2 and "RANK='zero' is not an integer" in capsys.readouterr().err


def test_a_bad_vllm_max_n_sequences_stops_the_server_before_it_loads(monkeypatch, capsys):
    """VLLM_MAX_N_SEQUENCES caps every request's n: a value that is no positive integer is said at start-up, as one
    line, not as each request's failure."""
    from tpgraph.serve import main

    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "0")
    assert main(["--device", "cpu"]) == 2
    assert "VLLM_MAX_N_SEQUENCES must be a positive integer" in capsys.readouterr().err


def test_the_model_may_be_given_positionally_as_vllm_serve_takes_it(capsys):
    """`vllm serve meta-llama/Llama-3.1-8B-Instruct ...` names the model positionally (vLLM's model_tag; --model is
    its deprecated spelling): the same command line here was refused as an unrecognized argument."""
    assert parse_args(["org/model", "--port", "8001"]).model == "org/model"
    assert parse_args(["--max-model-len", "64", "org/model"]).model == "org/model"
    assert parse_args(["--model", "org/model"]).model == "org/model"
    assert parse_args(["org/model", "--model", "org/model"]).model == "org/model"  # (the same model twice)
    assert parse_args([]).model is None  # (the built-in model)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["org/a", "--model", "org/b"])
    assert exit_.value.code == 2 and "org/a" in capsys.readouterr().err


def test_flag_names_with_underscores_are_vllms_dashed_ones():
    """vLLM's parser reads --max_num_seqs as --max-num-seqs (FlexibleArgumentParser; docker-compose files and scripts
    write them so): they were refused here as unrecognized. Only the names change, never a value."""
    args = parse_args(["--max_num_seqs=4", "--tensor_parallel_size", "2", "--served_model_name", "my_model",
                       "--enable_prefix_caching", "--no_enable_chunked_prefill", "--chat_template", "a_b"])
    assert (args.max_num_seqs, args.tensor_parallel_size, args.served_model_name) == (4, 2, ["my_model"])
    assert (args.enable_prefix_caching, args.enable_chunked_prefill, args.chat_template) == (True, False, "a_b")
    assert parse_args(["--override_generation_config={\"max_new_tokens\": 5}"]).override_generation_config == \
        {"max_new_tokens": 5}


def test_vllms_num_gpu_blocks_override_sets_the_kv_blocks():
    """--num-kv-blocks' help named vLLM's --num-gpu-blocks-override, which was refused as unrecognized."""
    assert engine_kwargs(parse_args(["--num-gpu-blocks-override", "60"]))["num_kv_blocks"] == 60
    assert engine_kwargs(parse_args(["--num-gpu-blocks-override=70"]))["num_kv_blocks"] == 70


@pytest.mark.parametrize("flags", [["-pp", "1"], ["--pipeline-parallel-size", "1"], ["-dp", "1"],
                                   ["--data-parallel-size=1"], ["--distributed-executor-backend", "mp"]])
def test_vllms_parallel_flags_are_taken_where_they_mean_what_runs_here(flags, monkeypatch):
    """vLLM's -pp / -dp at 1 and --distributed-executor-backend mp (its own worker processes, as `python -m
    tpgraph.serve -tp N` starts its ranks) were refused as unrecognized, though TPEngine takes the same keywords."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert engine_kwargs(parse_args(flags))["tp_size"] == 1


@pytest.mark.parametrize("flags,needle", [
    (["-pp", "2"], "--pipeline-parallel-size"), (["--data-parallel-size", "2"], "--data-parallel-size"),
])
def test_other_parallel_layouts_are_refused_naming_the_flag(flags, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err and "tensor parallelism" in err


def test_an_executor_backend_other_than_how_ranks_run_here_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # (the command line's way to start the ranks, not TPEngine(tensor_parallel_size=N), which it has no use for)
    with pytest.raises(ConfigError, match=r"--distributed-executor-backend 'ray' \(vLLM's\) is not taken: in a plain "
                                          r"process -tp N starts its own ranks, as vLLM's 'mp' does; give 'mp'"):
        engine_kwargs(parse_args(["--distributed-executor-backend", "ray"]))
    monkeypatch.setenv("WORLD_SIZE", "2")  # (under torchrun every rank builds an engine: vLLM's external_launcher)
    assert engine_kwargs(parse_args(["--distributed-executor-backend", "external_launcher"]))["tp_size"] == 2
    with pytest.raises(ConfigError, match="give 'external_launcher'"):
        engine_kwargs(parse_args(["--distributed-executor-backend", "mp"]))


@pytest.mark.parametrize("text,tokens", [("8192", 8192), ("8k", 8000), ("8K", 8192), ("25.6k", 25600), ("1M", 2 ** 20),
                                         (" 32K", 32768)])
def test_token_counts_take_vllms_human_readable_suffixes(text, tokens):
    """vLLM reads --max-model-len and --max-num-batched-tokens with k/m/g (x1000) and K/M/G (x1024) suffixes
    (human_readable_int): `--max-model-len 32k` was refused here as an invalid int."""
    kwargs = engine_kwargs(parse_args(["--max-model-len", text, f"--max-num-batched-tokens={text}"]))
    assert (kwargs["max_model_len"], kwargs["max_num_batched_tokens"]) == (tokens, tokens)


@pytest.mark.parametrize("text", ["auto", "AUTO", "-1"])
def test_max_model_len_auto_is_the_longest_the_cache_holds(text):
    """vLLM's --max-model-len -1 / auto: the model's context where the KV cache holds it, else the longest it holds;
    that is this engine's default (None). -1 went on to be refused after parsing as no positive integer."""
    assert engine_kwargs(parse_args(["--max-model-len", text]))["max_model_len"] is None


@pytest.mark.parametrize("flags,needle", [(["--max-model-len", "1.5K"], "1.5k"), (["--max-model-len", "8q"], "8q"),
                                          (["--max-num-batched-tokens", "auto"], "auto"),
                                          (["--max-model-len", "-2"], "-2"), (["--max-model-len", "infk"], "infk"),
                                          # (float()'s spellings, which vLLM's human_readable_int refuses: digits,
                                          # with a decimal point before k/m/g/t alone)
                                          (["--max-model-len", "1e3k"], "1e3k"), (["--max-model-len", "1_0k"], "1_0k"),
                                          (["--max-num-batched-tokens", ".5k"], ".5k"),
                                          (["--max-model-len", "+8k"], "+8k")])
def test_bad_token_counts_are_refused_naming_the_flag(flags, needle, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    err = capsys.readouterr().err
    assert flags[0] in err and needle in err


@pytest.mark.parametrize("name", ["enable_auto_tool_choice", "exclude_tools_when_tool_choice_none",
                                  "enable_prompt_tokens_details", "enable_request_id_headers", "allow_credentials",
                                  "disable_uvicorn_access_log", "disable_fastapi_docs", "return_tokens_as_token_ids",
                                  "enable_force_include_usage", "trust_remote_code", "enforce_eager"])
def test_vllms_boolean_flags_take_their_no_forms(name):
    """vLLM makes every boolean setting a pair, --X and --no-X (BooleanOptionalAction): a vLLM command line giving
    --no-enforce-eager or --no-trust-remote-code (a template that spells out the default) was refused here."""
    flag = name.replace("_", "-")
    extra = ["--tool-call-parser", "llama3_json"] if name == "enable_auto_tool_choice" else []
    assert getattr(parse_args([f"--{flag}", *extra]), name) is True
    assert getattr(parse_args([f"--{flag}", f"--no-{flag}"]), name) is False  # (the last one given wins)
    assert getattr(parse_args([]), name) is False


def test_a_tool_call_parser_without_auto_tool_choice_is_taken_as_vllm_takes_it(capsys):
    """vLLM starts with --tool-call-parser alone (legal there: "auto" is refused, as without a parser); here that
    vLLM command line was refused at start-up. --enable-auto-tool-choice alone is still refused, as vLLM's."""
    from tpgraph.serve import tool_options

    assert tool_options(parse_args(["--tool-call-parser", "hermes"])).parser is None
    assert tool_options(parse_args(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])).parser == "hermes"
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_a_yaml_config_file_gives_flags_that_the_command_line_overrides(tmp_path):
    """vLLM's --config FILE.yaml: each key a flag (true: --X, false: --no-X where there is one, a list its values, a
    mapping its JSON), the command line winning over the file. It was refused as an unrecognized argument."""
    config = tmp_path / "serve.yaml"
    config.write_text("model: org/model\nport: 9000\nmax_num_seqs: 4\nmax-model-len: 8K\nenable-prefix-caching: false\n"
                      "enforce-eager: true\ndisable-log-stats: false\nserved-model-name: [a, b]\n"
                      "override-generation-config: {temperature: 0.5}\n")
    args = parse_args(["--config", str(config), "--port", "9001"])
    assert (args.model, args.port, args.max_num_seqs, args.max_model_len) == ("org/model", 9001, 4, 8192)
    assert (args.enable_prefix_caching, args.enforce_eager, args.disable_log_stats) == (False, True, False)
    assert args.served_model_name == ["a", "b"] and args.override_generation_config == {"temperature": 0.5}
    assert parse_args(["other/model", f"--config={config}"]).model == "other/model"  # (the command line's model)
    assert parse_args(["--model", "other/model", "--config", str(config)]).model == "other/model"


def test_a_positional_model_is_not_taken_as_a_config_files_list_value(tmp_path):
    """The file's flags go before the command line's: where the file's last key was a list (served-model-name: [a])
    the model given positionally first was read as one more of its values, and the server had no model. vLLM keeps
    the positional model before the file's flags."""
    config = tmp_path / "serve.yaml"
    config.write_text("served-model-name: [a, b]\n")
    for argv in (["org/model", "--config", str(config)], ["--config", str(config), "org/model", "--port", "9001"]):
        args = parse_args(argv)
        assert (args.model, args.served_model_name) == ("org/model", ["a", "b"])


def test_a_config_files_value_that_begins_with_a_dash_is_the_flags_value(tmp_path):
    """A value written as its own word after the flag's name was read by argparse as another flag where it began with
    a dash (an API key "-k3y", a model name "-base"): the file was refused with "expected at least one argument"."""
    config = tmp_path / "serve.yaml"
    config.write_text('api-key: "-k3y"\nserved-model-name: "-base"\nmax-model-len: -1\n')
    args = parse_args(["--config", str(config)])
    assert (args.api_key, args.served_model_name, args.max_model_len) == (["-k3y"], ["-base"], None)


def test_a_config_files_null_leaves_the_flag_at_its_default(tmp_path):
    """A YAML null (`api-key:`, `served-model-name: null`) reached argparse as the text "None": the server asked for
    the key "None" and served a model named "None" (a null chat template or max-model-len was refused as "None"). As
    vLLM's optional flags read "None", it is the flag left out."""
    config = tmp_path / "serve.yaml"
    config.write_text("api-key:\nserved-model-name: null\nchat-template: null\nmax-model-len: null\nport: 9000\n")
    args = parse_args(["--config", str(config)])
    assert (args.api_key, args.served_model_name, args.chat_template, args.max_model_len) == (None, None, None, None)
    assert args.port == 9000


@pytest.mark.parametrize("name,text,needle", [
    ("serve.json", "{}", "YAML"), ("serve.yaml", "- a\n", "a mapping"), ("serve.yaml", "nonsense-flag: 1\n",
                                                                        "--nonsense-flag"),
])
def test_a_config_file_that_cannot_be_read_is_refused_naming_it(tmp_path, name, text, needle, capsys):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(tmp_path / name)])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["enable-prefix-cachng: false\n", "enable_lora: false\n", "nonsense-flag: null\n",
                                  "nonsense-flag: []\n"])
def test_a_config_files_key_naming_no_flag_is_refused_whatever_its_value(tmp_path, text, capsys):
    """A key that is no flag was refused where it had a value, but dropped without a word where it was false, null or
    an empty list: `enable-prefix-cachng: false` (a typo) left the prefix cache on, unsaid."""
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(config)])
    key = text.partition(":")[0].replace("_", "-")
    assert exit_.value.code == 2 and f"unrecognized arguments: --{key}=" in capsys.readouterr().err


def test_a_config_files_list_for_a_flag_of_one_value_is_refused(tmp_path, capsys):
    """`max-num-seqs: [4, 8]` became `--max-num-seqs 4 8`: the 8 was read as the positional model, and the server
    looked for a checkpoint named "8" (a list is a flag's values only where it takes several: served-model-name)."""
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: [4, 8]\n")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(config)])
    assert exit_.value.code == 2 and "max-num-seqs takes one value, got a list of 2: [4, 8]" in capsys.readouterr().err
    config.write_text("max-num-seqs: [4]\nserved-model-name: [a, b]\ncuda-graph-sizes: [1, 2]\n")
    args = parse_args(["--config", str(config)])
    assert (args.max_num_seqs, args.served_model_name, args.cuda_graph_sizes, args.model) == (4, ["a", "b"], [1, 2],
                                                                                             None)


def test_vllms_async_scheduling_is_the_overlapped_scheduling():
    """vLLM's --async-scheduling (on by default in its newer releases) schedules the next step before the last one's
    tokens are read: this engine's overlap scheduling. --async-scheduling / --no-async-scheduling were refused."""
    assert engine_kwargs(parse_args(["--async-scheduling"]))["overlap_scheduling"] is True
    assert engine_kwargs(parse_args(["--no-async-scheduling"]))["overlap_scheduling"] is False
    assert engine_kwargs(parse_args([]))["overlap_scheduling"] is True
    assert engine_kwargs(parse_args(["--no-overlap-scheduling"]))["overlap_scheduling"] is False


@pytest.mark.parametrize("value", ["auto", "string"])
def test_vllms_chat_template_content_format_is_taken_where_it_means_text(value):
    """vLLM's --chat-template-content-format string (and auto, its default, which picks string for a template that
    renders content as text, as Llama 3's do) hands the template each message's text parts joined: what this server
    does. The flag was refused as unrecognized."""
    assert parse_args(["--chat-template-content-format", value]).chat_template_content_format == value


def test_the_openai_content_format_is_taken_and_others_refused(capsys):
    """vLLM's openai format (each message's content a list of text parts) is served now that the template can be
    handed it; a value vLLM has not is refused, naming the flag."""
    assert parse_args(["--chat-template-content-format", "openai"]).chat_template_content_format == "openai"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--chat-template-content-format", "parts"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--chat-template-content-format" in err and "'openai'" in err


# (--compilation-config / -O set the CUDA graphs now: test_graph_config's test_vllms_compilation_config_flag_...)
@pytest.mark.parametrize("flags", [["--hf-token", "x"], ["--max-seq-len-to-capture", "8192"]])
def test_a_flag_not_taken_is_refused_saying_what_to_do(flags, capsys):
    """A vLLM flag this server has no setting for was refused as "unrecognized arguments" alone: the message now
    says to leave it out, and where the flags taken are listed."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(["org/model", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flags[0] in err and "leave it out" in err and "--help" in err


def test_a_second_positional_word_is_not_called_a_setting_the_server_lacks(capsys):
    """A word that is no flag (a second model, a value whose flag was mistyped away) was refused with the unknown
    flag's advice, that this server has no such setting: there is no setting named there. It is named alone, with
    what a positional word is (the model, once)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(["org/a", "org/b"])
    line = capsys.readouterr().err.strip().splitlines()[-1]  # (the usage above it names MODEL anyway)
    assert exit_.value.code == 2 and "org/b" in line and "no such setting" not in line and "one MODEL" in line


@pytest.mark.parametrize("argv", [["--api-key", "k3y", "org/model"], ["--served-model-name", "mine", "org/model"],
                                  ["--port", "8001", "--api-key", "a", "b", "DIR"]])
def test_a_model_read_as_a_list_flags_value_is_refused_saying_where_it_goes(argv, tmp_path, capsys):
    """`serve --api-key KEY org/model`: --api-key takes every word after it, so the model became a second key and the
    built-in model was served, guarded by a key named after the model. A word that names a model (a directory, or a
    hub id) among a list flag's later values, with no model given, is refused; the model first, it parses."""
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "was read as one more of its values, and no model is given: put the model " \
        "first" in capsys.readouterr().err
    model = argv[-1]
    args = parse_args([model, *argv[:-1]])
    assert args.model == model
    assert parse_args(["--api-key", "k1", "k2"]).api_key == ["k1", "k2"]  # (keys that name no model: as they are)


def test_decode_sizes_below_max_num_seqs_are_taken_as_vllm_takes_them():
    """Sizes topping out below --max-num-seqs were refused (naming the flag, then before the weights load); vLLM takes
    them and runs the larger batches eagerly, and so does this now (the runner says so at start-up)."""
    from tpgraph.engine.config import EngineConfig
    from tpgraph.graphs.config import GraphConfig

    for flags in (["--cuda-graph-sizes", "4"], ["--cudagraph-capture-sizes", "1", "2", "4"],
                  ["--max-cudagraph-capture-size", "4"], ["--cuda-graph-ladder", "1,2,4"]):
        graphs = engine_kwargs(parse_args(["--device", "cuda", *flags]))["graphs"]
        assert graphs.decode_sizes(8) == (1, 2, 4), flags
    assert EngineConfig(device="cuda", max_num_seqs=8, graphs=GraphConfig(ladder=(1, 2, 4)))


@pytest.mark.parametrize("flags,flag,setting", [
    (["-tp", "0"], "--tensor-parallel-size/-tp must be a positive integer, got 0", "tp_size"),
    (["--num-gpu-blocks-override", "-1"], "--num-kv-blocks/--num-gpu-blocks-override must be a positive integer",
     "num_kv_blocks"),
    (["--block-size", "24"], "--block-size must be a power of two", "block_size"),
    (["--max-num-batched-tokens", "4", "--max-num-seqs", "8"], "--max-num-batched-tokens (4) must be at least",
     "max_num_batched_tokens"),
    (["--max-model-len", "10m"], "--max-model-len 10000000 exceeds the model's", "max_model_len"),
    (["--kv-cache-memory-bytes", "1"], "--kv-cache-memory-bytes/--kv-cache-memory 1 holds 0 KV blocks",
     "kv_cache_memory_bytes"),
])
def test_engine_settings_refused_from_the_command_line_name_the_flag(flags, flag, setting, capsys):
    """EngineConfig's refusals named its fields (`-tp 0`: "tp_size must be a positive integer"), which a command-line
    user never typed; the CLI now names the flag, and TPEngine's keyword users still see the keyword."""
    from tpgraph.generate import main

    assert main(["--prompt", "hi", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert flag in err and setting not in err


def test_a_tp_size_from_torchruns_world_size_is_not_blamed_on_the_flag(monkeypatch):
    from tpgraph.engine.cli import engine_from_args

    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ConfigError, match="^tp_size must be a positive integer"):
        engine_from_args(parse_args([]))


@pytest.mark.parametrize("variable,value,needle", [
    ("VLLM_LOGGING_LEVEL", "LOUD", "VLLM_LOGGING_LEVEL='LOUD' is no logging level: give one of CRITICAL, ERROR, "
                                   "WARNING, INFO, DEBUG"),
    ("VLLM_CONFIGURE_LOGGING", "yes", "VLLM_CONFIGURE_LOGGING='yes' must be 1"),
    ("VLLM_LOGGING_STREAM", "stdout", "VLLM_LOGGING_STREAM='stdout' must be ext://sys.stdout or ext://sys.stderr"),
    # (vLLM's float() of it fails with a traceback; every stats line would have nothing to go by)
    ("VLLM_LOG_STATS_INTERVAL", "10s", "VLLM_LOG_STATS_INTERVAL='10s' is not a number of seconds"),
])
def test_a_bad_vllm_logging_variable_is_refused_when_parsed(variable, value, needle, monkeypatch, capsys):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("env,level", [
    ({}, "INFO"), ({"VLLM_LOGGING_LEVEL": "debug"}, "DEBUG"), ({"VLLM_LOGGING_LEVEL": "WARNING"}, "WARNING"),
    ({"VLLM_LOGGING_LEVEL": "warn"}, "WARNING"),  # (Python's logging, and so vLLM's, takes WARN too)
    # (vLLM's handler at NOTSET passes every line of its "vllm" logger, which is at DEBUG: refused here, it stopped
    # the server)
    ({"VLLM_LOGGING_LEVEL": "notset"}, "DEBUG"),
    ({"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_CONFIGURE_LOGGING": "0"}, "NOTSET"),
])
def test_the_servers_log_level_is_vllms_logging_level(env, level, monkeypatch):
    """vLLM's users set VLLM_LOGGING_LEVEL=DEBUG to see its debug lines (the idle stats line, ...), or WARNING to quiet
    it, and VLLM_CONFIGURE_LOGGING=0 to configure logging themselves: both processes logged at INFO whatever they
    said. The server's loggers take the level (other libraries stay at INFO: DEBUG is not every library's)."""
    import logging

    from tpgraph.server.logs import configure_logging

    for name in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours = logging.getLogger("tpgraph")
    monkeypatch.setattr(ours, "level", logging.NOTSET)  # (restored after)
    configure_logging()
    assert logging.getLevelName(ours.level) == level


@pytest.mark.parametrize("text,configure,needle", [
    (None, None, "VLLM_LOGGING_CONFIG_PATH='{path}' cannot be read as a JSON logging configuration"),
    ("{not json", None, "cannot be read as a JSON logging configuration"),
    ("[1, 2]", None, "must hold a JSON object (logging.config.dictConfig's schema), not a list"),
    ('{"version": 1}', "0", "VLLM_LOGGING_CONFIG_PATH='{path}' is given, but VLLM_CONFIGURE_LOGGING=0 says not to "
                            "configure logging"),
])
def test_a_vllm_logging_config_file_that_cannot_be_taken_is_refused_when_parsed(text, configure, needle, tmp_path,
                                                                               monkeypatch, capsys):
    path = tmp_path / "logging.json"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(path))
    if configure is not None:
        monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", configure)
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2 and needle.format(path=path) in capsys.readouterr().err


def test_vllms_logging_config_file_configures_the_servers_logging(tmp_path, monkeypatch, capsys):
    """vLLM configures its logging from VLLM_LOGGING_CONFIG_PATH's JSON file (dictConfig's schema) where it is set:
    the server ignored it. One dictConfig refuses stops the server at start-up, as one line."""
    import json
    import logging

    from tpgraph.serve import main
    from tpgraph.server.logs import configure_logging

    path = tmp_path / "logging.json"
    path.write_text(json.dumps({"version": 1, "incremental": True, "loggers": {"tpgraph": {"level": "ERROR"}}}))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(path))
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # (the file's configuration, not the server's, is taken)
    ours = logging.getLogger("tpgraph")
    monkeypatch.setattr(ours, "level", logging.NOTSET)  # (restored after)
    configure_logging(parse_args([]).http.log_config)
    assert ours.level == logging.ERROR
    path.write_text(json.dumps({"version": 2}))
    assert main(["--device", "cpu"]) == 2
    assert "VLLM_LOGGING_CONFIG_PATH" in capsys.readouterr().err


def test_vllms_log_config_file_flag_configures_the_servers_and_uvicorns_logging(tmp_path, monkeypatch, capsys):
    """vLLM's --log-config-file (default $VLLM_LOGGING_CONFIG_PATH) configures its loggers and uvicorn's: refused
    here as a setting the server lacks. The file's configuration reaches the front end, and uvicorn's log_config."""
    import json

    from tpgraph.server.frontend import FrontendSpec, uvicorn_config

    config = {"version": 1, "incremental": True, "loggers": {"uvicorn.access": {"level": "WARNING"}}}
    (tmp_path / "flag.json").write_text(json.dumps(config))
    (tmp_path / "env.json").write_text(json.dumps({"version": 1}))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "env.json"))  # (the flag's wins)
    http = parse_args(["--log-config-file", str(tmp_path / "flag.json")]).http
    assert http.log_config == config
    spec = FrontendSpec("127.0.0.1", 8000, "m", 64, None, None, http=http)
    assert uvicorn_config(object(), spec).log_config == config
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH")
    assert parse_args([]).http.log_config is None
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--log-config-file", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2
    assert f"--log-config-file {tmp_path / 'missing.json'} cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("configure", [None, "0"])  # (uvicorn takes the flag's file whatever that says)
def test_a_log_config_file_uvicorn_would_refuse_is_refused_when_parsed(configure, tmp_path, monkeypatch, capsys):
    """A --log-config-file whose configuration dictConfig refuses (a handler class that does not exist) was found
    only as the HTTP front end started, once every rank had loaded the weights; it is refused when parsed, naming the
    file and dictConfig's reason. uvicorn's own TRACE level is taken, as uvicorn names it before configuring."""
    import json

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    if configure is not None:
        monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", configure)
    path = tmp_path / "uvicorn.json"
    path.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                "handlers": {"h": {"class": "logging.NoSuchHandler"}},
                                "loggers": {"uvicorn": {"handlers": ["h"]}}}))
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--log-config-file", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"--log-config-file {path} is no logging configuration uvicorn takes" in err
    assert "Unable to configure handler 'h'" in err, err
    taken = {"version": 1, "disable_existing_loggers": False,
             "loggers": {"uvicorn.access": {"level": "TRACE"}}}
    path.write_text(json.dumps(taken))
    assert parse_args(["--log-config-file", str(path)]).http.log_config == taken


def test_a_log_config_file_is_checked_after_the_servers_own_as_the_front_end_applies_them(tmp_path, monkeypatch):
    """The front end applies VLLM_LOGGING_CONFIG_PATH's configuration, then uvicorn the --log-config-file's: an
    incremental file for uvicorn that changes a handler the server's file made is taken (the check applied it alone,
    and refused it as naming no handler)."""
    import json

    server = tmp_path / "server.json"
    server.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                  "handlers": {"console": {"class": "logging.StreamHandler"}},
                                  "loggers": {"tpgraph": {"handlers": ["console"], "level": "INFO"}}}))
    uvicorn = tmp_path / "uvicorn.json"
    uvicorn.write_text(json.dumps({"version": 1, "incremental": True, "handlers": {"console": {"level": "WARNING"}}}))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(server))
    http = parse_args(["--log-config-file", str(uvicorn)]).http
    assert http.log_config == {"version": 1, "incremental": True, "handlers": {"console": {"level": "WARNING"}}}


def test_vllms_logging_prefix_and_stream_set_where_the_lines_go_and_how_they_begin():
    """vLLM begins each line with VLLM_LOGGING_PREFIX and writes to VLLM_LOGGING_STREAM (ext://sys.stdout or
    ext://sys.stderr): the server ignored both. (A process of its own: logging is configured once a process.)"""
    import os
    import subprocess
    import sys

    code = ("from tpgraph.server.logs import configure_logging; configure_logging(); "
            "import logging; logging.getLogger('tpgraph.serve').info('serving')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VLLM_LOGGING_PREFIX": "[node 3, 100%] ",
           "VLLM_LOGGING_STREAM": "ext://sys.stdout"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "[node 3, 100%] INFO tpgraph.serve: serving\n" and run.stderr == ""
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.stderr == "[node 3, 100%] INFO tpgraph.serve: serving\n" and run.stdout == ""


def test_vllms_logging_prefix_fills_in_its_log_record_fields_and_never_breaks_a_line():
    """vLLM puts VLLM_LOGGING_PREFIX into its logging format, so that "%(process)d" is each line's process id and "%%"
    a percent sign: the server wrote them as they were typed. A % that begins no field ("100%") is the character
    itself (vLLM's logging failed every line with it); a field no log record has is refused when parsed, naming the
    variable, as every line would fail."""
    import os
    import subprocess
    import sys

    code = ("from tpgraph.server.logs import configure_logging; configure_logging(); "
            "import logging, os; print(os.getpid()); logging.getLogger('tpgraph.serve').info('serving')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VLLM_LOGGING_STREAM": "ext://sys.stdout",
           "VLLM_LOGGING_PREFIX": "(pid=%(process)d, %(processName)s) 100%% 50% %%%(levelno)d "}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    pid, line = run.stdout.splitlines()
    assert line == f"(pid={pid}, MainProcess) 100% 50% %20 INFO tpgraph.serve: serving"


@pytest.mark.parametrize("prefix,needle", [
    ("%(rank)s ", "VLLM_LOGGING_PREFIX='%(rank)s ' cannot begin a log line: Formatting field not found in record: "
                  "'rank'"),
    ("%(process)q ", "VLLM_LOGGING_PREFIX='%(process)q ' cannot begin a log line: unsupported format character 'q'"),
])
def test_a_logging_prefix_whose_field_no_record_fills_is_refused_when_parsed(prefix, needle, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_PREFIX", prefix)
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_the_logged_url_is_one_a_client_can_use():
    """`--host ::1` was logged as serving on http://::1:8000, which no client reads as a host and a port."""
    from tpgraph.serve import serving_url

    assert serving_url(parse_args(["--host", "::1"]).http, "::1", 8000) == "http://[::1]:8000"
    assert serving_url(parse_args([]).http, "127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert serving_url(parse_args(["--uds", "/run/api.sock"]).http, "127.0.0.1", 8000) == "http+unix:///run/api.sock"


def test_an_empty_host_listens_on_every_interface_as_vllms_default(capsys):
    """vLLM's --host defaults to none, every interface, and takes `--host ""` for it (as uvicorn's asyncio server
    does): the start-up check looked the empty name up, and refused it ("Name or service not known"). Every address
    the server binds is checked: a port taken on IPv6 alone is refused too."""
    import socket

    from tpgraph.serve import serving_url
    from tpgraph.server.listeners import bind_sockets, close_sockets

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    close_sockets(bind_sockets("", free))
    assert serving_url(parse_args(["--host", ""]).http, "", 8000) == "http://0.0.0.0:8000"
    if not socket.has_ipv6:
        return
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            taken.bind(("::", 0))
        except OSError:
            return  # (no IPv6 here)
        taken.listen()
        with pytest.raises(ConfigError, match=r"cannot listen on \*:\d+: Address already in use"):
            bind_sockets("", taken.getsockname()[1])


def test_a_log_config_file_whose_name_holds_braces_is_read(tmp_path):
    """The flag's path was put through str.format: a file named {site}.json stopped the server with a KeyError."""
    import json

    path = tmp_path / "{site}.json"
    path.write_text(json.dumps({"version": 1, "incremental": True}))
    assert parse_args(["--log-config-file", str(path)]).http.log_config == {"version": 1, "incremental": True}



def test_a_vllm_logging_config_file_configures_the_servers_loggers_as_vllms(tmp_path):
    """vLLM's logging configuration files (its documented example among them) configure the "vllm" logger, and leave
    disable_existing_loggers at dictConfig's True: taken as it was, such a file disabled every tpgraph logger already
    made, so the server logged nothing at all, errors included. Its "vllm" logger configures the server's loggers."""
    import json
    import os
    import subprocess
    import sys

    path = tmp_path / "logging.json"
    path.write_text(json.dumps({
        "version": 1, "formatters": {"f": {"format": "CFG %(name)s %(message)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "f", "level": "INFO",
                                 "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["console"], "level": "INFO", "propagate": False}}}))
    code = ("from tpgraph.serve import logger; from tpgraph.server.logs import configure_logging, logging_config; "
            "configure_logging(logging_config()); logger.error('the engine loop stopped')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VLLM_LOGGING_CONFIG_PATH": str(path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "CFG tpgraph.serve the engine loop stopped\n"


def test_a_log_config_file_for_uvicorn_is_taken_where_the_server_configures_no_logging(tmp_path, monkeypatch):
    """vLLM's --log-config-file is uvicorn's: VLLM_CONFIGURE_LOGGING=0 (vLLM's own loggers left alone) does not stop
    it, as it stops VLLM_LOGGING_CONFIG_PATH's. The pair was refused ("leave out one of them")."""
    import json

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    path = tmp_path / "uvicorn.json"
    path.write_text(json.dumps({"version": 1, "disable_existing_loggers": False}))
    http = parse_args(["--log-config-file", str(path)]).http
    assert http.log_config == {"version": 1, "disable_existing_loggers": False} and http.server_log_config is None


def test_a_reasoning_parser_the_tokenizer_cannot_serve_is_refused_before_the_weights_load(monkeypatch, capsys):
    """--reasoning-parser deepseek_r1 for a model whose tokenizer splits </think> was refused only once the engine
    was built, every rank's weights loaded (minutes, for a large model); the tokenizer is a file, read first."""
    import socket

    import tpgraph.serve as serve

    def built(args):
        raise AssertionError("the engine was built (its weights loaded) before the refusal")

    monkeypatch.setattr(serve, "engine_from_args", built)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve.main(["--device", "cpu", "--port", str(port), "--reasoning-parser", "deepseek_r1"]) == 2
    assert "--reasoning-parser deepseek_r1 needs a model whose tokenizer has </think> as one token" in \
        capsys.readouterr().err


def test_the_server_hands_its_logging_set_up_to_the_ranks_it_starts(monkeypatch, capsys):
    """`-tp 2` without torchrun: the engine starts rank 1 itself, which must log as rank 0 does (VLLM_LOGGING_*):
    serve.main gives the engine its own logging set-up, with the same configuration, for those ranks to run first."""
    from tpgraph import ConfigError, serve
    from tpgraph.server.logs import configure_logging

    handed = {}

    def refuse(args, rank_setup=None):
        handed["setup"] = rank_setup
        raise ConfigError("stop here")

    monkeypatch.setattr(serve, "engine_from_args", refuse)
    monkeypatch.setattr(serve, "front_end_sockets", lambda *a: [])
    assert serve.main(["--device", "cpu", "-tp", "2"]) == 2 and "stop here" in capsys.readouterr().err
    setup = handed["setup"]
    config = serve.parse_args(["--device", "cpu"]).http.server_log_config
    assert setup.func is configure_logging and setup.args == (config,)


def test_the_reasoning_parsers_early_check_takes_disable_sliding_window(tmp_path):
    """--disable-sliding-window --reasoning-parser ...: the check before the weights load read config.json without
    the flag, so a sliding-window checkpoint (Mistral-7B-v0.1's) the engine runs was refused as one it cannot."""
    import json

    import tpgraph.serve as serve
    from tpgraph.config import BUILTIN_MODEL

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": BUILTIN_MODEL.vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "sliding_window": 128}))
    args = parse_args(["--model", str(tmp_path / "c"), "--disable-sliding-window", "--reasoning-parser", "deepseek_r1"])
    with pytest.raises(ConfigError) as refused:  # (the byte tokenizer splits </think>: that refusal, no other)
        serve.reasoning_parser(args)
    assert "</think>" in str(refused.value) and "sliding_window" not in str(refused.value)


def parsers_of(monkeypatch, *parse_functions):
    """The argparse parsers that these parse_args functions build (caught as they parse)."""
    import argparse

    built = []

    def caught(parser, *args, **kwargs):
        built.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    for parse in parse_functions:
        with pytest.raises(SystemExit):
            parse([])
    return built


def test_help_shows_each_numeric_or_address_default(monkeypatch):
    """--help showed no default for --max-num-seqs (8, where vLLM's is 256), --host (127.0.0.1, where vLLM's listens
    on every interface), --port, --block-size, --seed, --gpu-memory-utilization or tpgraph-tune's --runs,
    --tolerance, --min-points and --max-bytes: a vLLM user read vLLM's defaults into them."""
    from tpgraph import generate
    from tpgraph.tune import cli as tune

    shown = []
    for parser in parsers_of(monkeypatch, parse_args, generate.parse_args, tune.parse_args):
        for action in parser._actions:
            default = action.default
            numeric = isinstance(default, int | float) and not isinstance(default, bool)
            if action.option_strings and (numeric or action.dest == "host"):
                text = parser._get_formatter()._expand_help(action) if action.help else ""
                assert re.search(rf"default:? {re.escape(str(default))}\b", text, re.IGNORECASE), \
                    f"{parser.prog} {action.option_strings[0]}: help {text!r} shows no default {default!r}"
                shown.append(action.option_strings[0])
    assert {"--max-num-seqs", "--host", "--port", "--runs", "--max-bytes"} <= set(shown)


def test_api_key_help_names_every_route_left_open(monkeypatch):
    """--api-key's help listed /health, /ping, /metrics and /version as the routes left open, but the API docs
    (/docs, /redoc, /openapi.json) are open too, as vLLM leaves them: a user hiding the schema behind the key was
    told it was."""
    from tpgraph.server.auth import OPEN_PATHS

    parser, = parsers_of(monkeypatch, parse_args)
    action = parser._option_string_actions["--api-key"]
    text = " ".join(parser._get_formatter()._expand_help(action).split())
    assert [path for path in sorted(OPEN_PATHS - {"/docs/oauth2-redirect"}) if path not in text] == []


def test_the_readme_names_every_flag_the_commands_take(monkeypatch):
    """The README, which says what each command takes, named neither --compilation-config (vLLM's -O),
    --num-gpu-blocks-override, --kv-cache-memory-bytes, --seed, --block-size, the generate command's sampling flags
    nor tpgraph-tune's --runs, --tolerance, --min-points, --max-bytes and --table."""
    import argparse
    from pathlib import Path

    from tpgraph import generate
    from tpgraph.tune import cli as tune

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = []
    for parser in parsers_of(monkeypatch, parse_args, generate.parse_args, tune.parse_args):
        for action in parser._actions:
            names = [n for n in action.option_strings if n.startswith("--") and not n.startswith("--no-")]
            if action.help == argparse.SUPPRESS or not names or "--help" in names:
                continue
            if not any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", readme) for name in names):
                missing.append(f"{parser.prog} {names[0]}")
    assert missing == []


def test_tp_help_says_what_a_plain_process_takes(monkeypatch):
    """-tp's help said its default "and required value" is torchrun's world size, but a plain process takes any -tp N
    (and starts the other ranks itself); --device and --load-format said no default at all."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert engine_kwargs(parse_args(["-tp", "2", "--device", "cpu"]))["tp_size"] == 2
    parser, = parsers_of(monkeypatch, parse_args)
    helps = {flag: " ".join(parser._get_formatter()._expand_help(parser._option_string_actions[flag]).split())
             for flag in ("-tp", "--device", "--load-format")}
    assert "required value" not in helps["-tp"] and "plain process 1 by default" in helps["-tp"]
    assert "default: cuda where a GPU is visible, else cpu" in helps["--device"]
    assert "default: auto" in helps["--load-format"]


@pytest.mark.parametrize("argv", [["serve", "org/model"], ["serve"], ["serve", "org/model", "--port", "9000"]])
def test_vllms_serve_subcommand_typed_out_of_habit_is_refused_saying_so(argv, tmp_path, monkeypatch, capsys):
    """`tpgraph-serve serve org/model` (as `vllm serve org/model`) took "serve" as the model and refused org/model as a
    second one; `tpgraph-serve serve` looked for a checkpoint named "serve". A directory named serve is still a
    model."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "`serve` is vLLM's subcommand (vllm serve MODEL)" in capsys.readouterr().err
    (tmp_path / "serve").mkdir()
    assert parse_args(["serve"]).model == "serve"
