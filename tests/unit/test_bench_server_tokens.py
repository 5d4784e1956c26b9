"""bench/bench_server_tokens.py: the front end's per-token cost, timed on CPU through the real app."""

import asyncio

import pytest
from tpgtest.bench_modules import load_bench_module


def test_a_run_streams_every_token_of_every_stream_and_times_it():
    bench = load_bench_module("bench_server_tokens")
    for api in ("chat", "completions"):
        run = asyncio.run(bench.run_once(3, 4, api, 2, True, None))
        assert run["tokens"] == 12 and run["chunks"] > 12 and run["bytes"] > 0, run
        assert run["server_cpu_us_per_token"] > 0 and run["tokens_per_s"] > 0


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--streams", "2", "-1"], ["--tokens", "0"],
                                  ["--min-total", "-1"], ["--repeat", "0"], ["--logprobs", "-1"],
                                  ["--logprobs", "21"]])
def test_arguments_that_cannot_run_are_refused_before_anything_runs(argv, monkeypatch, capsys):
    """(--streams 0 divided by zero, --repeat 0 took the median of no runs, and --tokens 0 or a --logprobs the
    server refuses failed on an assert inside a stream, each after the warm-up run.)"""
    bench = load_bench_module("bench_server_tokens")

    def ran(*_):
        raise AssertionError("a run started")

    monkeypatch.setattr(bench, "run_once", ran)
    monkeypatch.setattr("sys.argv", ["bench_server_tokens.py", *argv])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert "must be" in capsys.readouterr().err
