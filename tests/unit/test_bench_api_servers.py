"""bench/bench_api_servers.py: the front ends' streaming capacity against their number, through real front-end
processes, a real bridge and HTTP clients, with a fake engine."""

import json
from collections import Counter

import pytest
from tpgtest.bench_modules import load_bench_module


def test_each_count_streams_every_token_of_every_stream_and_reports_a_row(tmp_path):
    """(Chat's: its streams have chunks that carry no token, the first one's role and the finish, not counted.)"""
    bench = load_bench_module("bench_api_servers")
    out, image = tmp_path / "asc.json", tmp_path / "asc.png"
    rows = bench.main(["--api-server-counts", "1,2", "--streams", "4", "--tokens", "20", "--client-procs", "1",
                       "--api", "chat", "--out", str(out), "--plot", str(image)])
    saved = json.loads(out.read_text())["results"]
    assert [r["api_server_count"] for r in saved] == [1, 2] and saved == json.loads(json.dumps(rows))
    for r in saved:
        # every stream got all its tokens, and nothing else was counted as one (the role chunk, the finish, [DONE])
        assert r["all_received"] and r["received_min"] == 20 and r["received_total"] == 4 * 20, r
        assert sum(r["streams_per_frontend"]) == 4 and len(r["streams_per_frontend"]) <= r["api_server_count"]
        assert len(r["frontend_cpu_s"]) == r["api_server_count"]
        assert 0 < r["tokens_per_s"] <= 1.2 * r["offered_tokens_per_s"] == 1.2 * 400
        assert r["frontend_cpu_us_per_token"] > 0 and r["busiest_client_util"] > 0
    assert image.stat().st_size > 0


def test_a_completions_point_with_an_engine_as_fast_as_it_can():
    bench = load_bench_module("bench_api_servers")
    r = bench.run_point(1, 3, 10, 0.0, "completions", 2)
    assert r["all_received"] and r["received_total"] == 3 * 10 and r["offered_tokens_per_s"] is None, r
    assert r["client_procs"] == 2 and r["tokens_per_s"] > 0


def test_chat_streams_count_only_the_chunks_that_carry_text():
    bench = load_bench_module("bench_api_servers")
    role = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
    token = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}'
    quote = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "\\""}}]}'
    finish = b'data: {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}'
    assert [bench.carries_token(e, "chat") for e in (role, token, quote, finish, b"data: [DONE]")] == [
        False, True, True, False, False]
    assert bench.carries_token(b'data: {"choices": [{"text": "a"}]}', "completions")
    assert not bench.carries_token(b'data: {"choices": [{"text": ""}]}', "completions")


def test_the_steady_span_runs_from_the_last_stream_to_start_to_the_first_to_end():
    bench = load_bench_module("bench_api_servers")
    b = bench.BIN_S
    # a stream from bin 0 to 99, one from bin 10 to 59: 1 token a bin each; the span is bins [10, 59)
    early = bench.StreamResult(100, 0.5 * b, 99.5 * b, True)
    late = bench.StreamResult(50, 10.5 * b, 59.5 * b, True)
    bins = Counter({i: 1 for i in range(100)}) + Counter({i: 1 for i in range(10, 60)})
    rate, start, end, tokens = bench.steady_rate([bench.ClientRound(streams=[early, late], bins=bins)])
    assert (round(start / b), round(end / b), tokens) == (11, 59, 2 * 48)
    assert rate == pytest.approx(2 / b)


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--tokens", "0"], ["--client-procs", "0"],
                                  ["--step-ms", "-1"], ["--api-server-counts", "1,0"], ["--api-server-counts", ","]])
def test_arguments_that_cannot_run_are_refused_before_anything_runs(argv, monkeypatch, capsys):
    bench = load_bench_module("bench_api_servers")

    def ran(*_):
        raise AssertionError("a point ran")

    monkeypatch.setattr(bench, "run_point", ran)
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    assert "must be" in capsys.readouterr().err
