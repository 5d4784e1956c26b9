"""bench/bench_allreduce.py on CPU: every candidate's graph captured first, each custom one inside its own released()
context, all timed by one interleaved call, and the graphs dropped before their registrations are given back."""

import contextlib
import weakref

import pytest
from tpgtest.bench_modules import load_bench_module

KB, MB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def bench():
    return load_bench_module("bench_allreduce")


def test_more_graph_rounds_at_small_sizes(bench):
    assert bench.graph_runs(4 * KB, 20) == 100
    assert bench.graph_runs(4 * MB, 20) == 100
    assert bench.graph_runs(4 * MB, 180) == 180
    assert bench.graph_runs(8 * MB, 20) == 20
    text = bench.method(20)
    assert "interleaved" in text and "100 rounds up to 4 MB" in text and "20 above" in text


def test_graphs_are_captured_first_timed_together_and_dropped_before_release(bench, monkeypatch):
    events = []

    class Graph:
        def __init__(self, name):
            self.name = name

    @contextlib.contextmanager
    def released(custom):
        events.append(("open", custom))
        yield lambda: contextlib.nullcontext(custom)
        events.append(("release", custom))

    def capture(fn, k, ctx):
        with ctx() as custom:
            name = fn()
        graph = Graph(name)
        events.append(("capture", name, custom))
        weakref.finalize(graph, events.append, ("drop", name))
        return graph

    def interleaved(state, graphs, k, runs):
        events.append(("time", tuple(graphs), k, runs))
        return {name: float(i) for i, name in enumerate(graphs)}

    monkeypatch.setattr(bench, "released", released)
    monkeypatch.setattr(bench, "capture", capture)
    monkeypatch.setattr(bench, "graph_ops_us_interleaved", interleaved)
    cands = {"nccl": (lambda: "nccl", None), "1shot_push": (lambda: "1shot_push", "forced"),
             "1shot_pull": (lambda: "1shot_pull", "forced"), "auto": (lambda: "auto", "ar")}
    assert bench.graph_times(None, cands, 50) == {"nccl": 0.0, "1shot_push": 1.0, "1shot_pull": 2.0, "auto": 3.0}
    names = list(cands)
    kinds = [e[0] for e in events]
    assert kinds == ["open", "capture"] * 4 + ["time"] + ["drop"] * 4 + ["release"] * 4
    assert [e[1:] for e in events if e[0] == "capture"] == [(n, cands[n][1]) for n in names]
    assert events[8] == ("time", tuple(names), bench.K_OPS, 50)
    assert [e[1] for e in events if e[0] == "release"] == ["ar", "forced", "forced", None]  # last opened, first


def test_graphs_are_dropped_before_release_when_timing_fails(bench, monkeypatch):
    events = []

    @contextlib.contextmanager
    def released(custom):  # like the real one: gives back in a finally
        try:
            yield contextlib.nullcontext
        finally:
            events.append("release")

    class Graph:
        pass

    def capture(fn, k, ctx):
        graph = Graph()
        weakref.finalize(graph, events.append, "drop")
        return graph

    def interleaved(state, graphs, k, runs):
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(bench, "released", released)
    monkeypatch.setattr(bench, "capture", capture)
    monkeypatch.setattr(bench, "graph_ops_us_interleaved", interleaved)
    with pytest.raises(RuntimeError, match="a rank failed"):
        bench.graph_times(None, {"a": (None, "ar"), "b": (None, "ar")}, 20)
    assert events == ["drop", "drop", "release", "release"]


def test_a_forced_algorithm_runs_on_the_products_workspace_where_it_fits(bench):
    from types import SimpleNamespace

    from tpgraph.comm.thresholds import Algo

    product = SimpleNamespace(push_slot_bytes=16 << 20, staging_bytes=4096)
    roomy = SimpleNamespace(push_slot_bytes=64 << 20, staging_bytes=64 << 20)
    pick = bench.forced_instance
    assert pick(product, roomy, Algo.PUSH_1SHOT, 4096) is product  # auto's own launch, on auto's own memory
    assert pick(product, roomy, Algo.PUSH_1SHOT, 16 << 20) is product
    assert pick(product, roomy, Algo.PUSH_1SHOT, 64 << 20) is product  # beyond the slot: in pieces, as auto runs it
    assert pick(product, roomy, Algo.PULL_1SHOT, 4096) is product
    assert pick(product, roomy, Algo.PULL_2SHOT, 8192) is roomy  # eager pulls stage; the product has 4 KB
