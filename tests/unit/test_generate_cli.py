"""`python -m tpgraph.generate`, the offline command-line generator, as a new user runs it (in-process through main)."""

from __future__ import annotations

import pytest

from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.tp_engine import TPEngine
from tpgraph.generate import main

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
    assert "top_p must be in (0.0, 1.0]" in capsys.readouterr().err
