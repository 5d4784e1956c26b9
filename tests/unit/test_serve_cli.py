"""The server's and the engine's flags: values that can only fail later (after minutes of loading, or as a spinning
loop) are refused when parsed."""

import pytest

from tpgraph.engine.cli import engine_kwargs
from tpgraph.serve import parse_args


@pytest.mark.parametrize("flags,needle", [
    (["--port", "0"], "a port is 1-65535"), (["--port", "70000"], "a port is 1-65535"),
    (["--heartbeat-s", "0"], "must be a positive number"), (["--heartbeat-s", "-1"], "must be a positive number"),
    (["--heartbeat-s", "inf"], "must be a positive number"),
    (["--gpu-memory-utilization", "0"], "must be in (0, 1]"), (["--gpu-memory-utilization", "1.5"], "must be in"),
    (["--gpu-memory-utilization", "nan"], "must be in"),
    (["--api-key", ""], "the API key is empty"), (["--api-key", "  "], "the API key is empty"),
])
def test_bad_values_are_refused_when_parsed(flags, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_good_values_parse():
    args = parse_args(["--port", "65535", "--heartbeat-s", "0.25", "--gpu-memory-utilization", "1"])
    assert (args.port, args.heartbeat_s, args.gpu_memory_utilization) == (65535, 0.25, 1.0)
    assert engine_kwargs(parse_args(["--num-kv-blocks", "60"]))["num_kv_blocks"] == 60  # (preemption on a CPU server)
    assert engine_kwargs(args)["num_kv_blocks"] is None
    assert engine_kwargs(args)["enable_prefix_caching"] is True
    assert engine_kwargs(parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False


def test_tp_zero_is_passed_on_to_be_refused_not_taken_as_the_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert engine_kwargs(parse_args(["-tp", "0"]))["tp_size"] == 0
    assert engine_kwargs(parse_args([]))["tp_size"] == 2


@pytest.mark.parametrize("kw,needle", [
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization must be in"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128},
     "without chunked prefill, max_num_batched_tokens"),
    ({"tp_size": 0}, "tp_size must be a positive integer"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False"),
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
    assert parse_args([]).api_key is None
    monkeypatch.setenv("TPGRAPH_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env" and parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.setenv("TPGRAPH_API_KEY", "")
    assert parse_args([]).api_key is None  # (set but empty: no key, not a key of "")
