"""tpgraph/tune/timing.py: the interleaved graph timing's order of candidates per round and its aggregation (per
candidate medians per rank, then the slowest rank per candidate), on CPU with fake runs."""

import itertools
import statistics
from types import SimpleNamespace

import pytest

from tpgraph.tune import timing
from tpgraph.tune.timing import MIN_RUNS, interleaved_medians, round_order, slowest_per_candidate


def test_round_order_is_a_williams_design():
    names = ["a", "b", "c", "d"]
    assert [round_order(names, r) for r in range(5)] == [
        ["a", "b", "d", "c"], ["b", "c", "a", "d"], ["c", "d", "b", "a"], ["d", "a", "c", "b"], ["a", "b", "d", "c"]]
    assert round_order(["only"], 7) == ["only"]
    assert round_order([], 3) == []


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9])
def test_every_candidate_takes_every_position_and_follows_every_other_equally_often(n):
    names = [f"c{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    orders = [round_order(names, r) for r in range(3 * period)]
    for order in orders:
        assert sorted(order) == sorted(names)  # one run of each per round
    for pos in range(n):
        counts = {name: sum(o[pos] == name for o in orders) for name in names}
        assert len(set(counts.values())) == 1, (pos, counts)
    follows = {(a, b): 0 for a in names for b in names if a != b}
    for order in orders:
        for a, b in itertools.pairwise(order):
            follows[(a, b)] += 1
    assert len(set(follows.values())) == 1, follows  # no candidate always runs after the same one


def test_interleaved_medians_runs_the_rounds_in_order_and_takes_each_candidates_median():
    names = ["auto", "1shot_push", "nccl"]
    calls = []
    base = {"auto": 100.0, "1shot_push": 200.0, "nccl": 1000.0}

    def run_one(name):
        calls.append(name)
        return base[name] + len(calls)  # drifts upward over time: every candidate sees the drift alike

    runs = MIN_RUNS
    out = interleaved_medians(names, runs, run_one, per=10)
    assert calls == [n for r in range(runs) for n in round_order(names, r)]
    samples = {n: [base[n] + i + 1 for i, c in enumerate(calls) if c == n] for n in names}
    assert out == {n: statistics.median(samples[n]) / 10 for n in names}
    assert list(out) == names  # the caller's order, whatever the rounds did
    # drift shared: the medians differ by the base difference alone (within one round's span)
    assert abs((out["1shot_push"] - out["auto"]) * 10 - 100.0) <= len(names)


def test_interleaved_medians_keeps_the_methods_minimum_and_unique_names():
    with pytest.raises(ValueError, match="at least"):
        interleaved_medians(["a"], MIN_RUNS - 1, lambda name: 1.0)
    with pytest.raises(ValueError, match="repeat"):
        interleaved_medians(["a", "a"], MIN_RUNS, lambda name: 1.0)


def test_slowest_rank_per_candidate():
    assert slowest_per_candidate([{"a": 2.0, "b": 5.0}, {"a": 3.0, "b": 4.0}]) == {"a": 3.0, "b": 5.0}
    assert slowest_per_candidate([{"a": 2.0}]) == {"a": 2.0}
    with pytest.raises(ValueError, match="rank 1"):
        slowest_per_candidate([{"a": 2.0, "b": 5.0}, {"b": 4.0, "a": 3.0}])


def test_a_rank_without_a_figure_is_the_slowest_whichever_rank_it_is(monkeypatch):
    """max() over the ranks kept the first rank's figure when a later one was NaN, and NaN when rank 0's was: the
    table depended on which rank failed, and a failed rank's candidate could be timed by the others alone."""
    nan, inf = float("nan"), float("inf")
    assert slowest_per_candidate([{"a": 5.0, "b": 1.0}, {"a": nan, "b": 2.0}]) == {"a": inf, "b": 2.0}
    assert slowest_per_candidate([{"a": nan, "b": 1.0}, {"a": 5.0, "b": 2.0}]) == {"a": inf, "b": 2.0}
    for others in ([nan, 5.0], [5.0, nan]):
        monkeypatch.setattr(timing, "gather_objects", lambda state, obj, others=others: others)
        assert timing.slowest_median(SimpleNamespace(world_size=2), [1.0] * MIN_RUNS) == inf


class FakeGraph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)


def fake_run(us_of):
    """An _aligned_run stand-in: runs the body (a graph's replay) and returns its made-up µs."""
    def run(state, body, token):
        body()
        return us_of(body.__self__.name)
    return run


def test_graph_ops_us_interleaved_one_process(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "_aligned_run", fake_run({"x": 640.0, "y": 128.0}.get))
    graphs = {"x": FakeGraph("x", log), "y": FakeGraph("y", log)}
    assert timing.graph_ops_us_interleaved(None, graphs, k=64, runs=MIN_RUNS) == {"x": 10.0, "y": 2.0}
    assert log == [n for r in range(MIN_RUNS) for n in round_order(["x", "y"], r)]


def test_graph_ops_us_interleaved_gathers_once_and_takes_the_slowest_rank(monkeypatch):
    gathers = []

    def gather(state, obj):
        gathers.append(obj)
        if isinstance(obj, list):  # the names, checked before any run: the other rank times the same
            return [obj, list(obj)]
        return [obj, {"x": 9.0, "y": 3.0}]  # the other rank: slower on y, faster on x

    monkeypatch.setattr(timing, "_aligned_run", fake_run({"x": 640.0, "y": 128.0}.get))
    monkeypatch.setattr(timing, "_alignment_token", lambda state: None)
    monkeypatch.setattr(timing, "gather_objects", gather)
    state = SimpleNamespace(world_size=2)
    out = timing.graph_ops_us_interleaved(state, {"x": FakeGraph("x", []), "y": FakeGraph("y", [])}, 64, MIN_RUNS)
    assert out == {"x": 10.0, "y": 3.0}
    assert gathers == [["x", "y"], {"x": 10.0, "y": 2.0}]  # the names first, then one gather of the whole dict


def test_ranks_that_would_time_different_candidates_stop_before_any_run(monkeypatch):
    runs = []
    monkeypatch.setattr(timing, "_aligned_run", lambda state, body, token: runs.append(1) or 1.0)
    monkeypatch.setattr(timing, "gather_objects", lambda state, obj: [obj, ["x"]])
    with pytest.raises(RuntimeError, match="different candidates"):
        timing.graph_ops_us_interleaved(SimpleNamespace(world_size=2), {"x": FakeGraph("x", []),
                                                                         "y": FakeGraph("y", [])}, 64, MIN_RUNS)
    assert runs == []


def test_graph_op_us_goes_through_the_shared_run(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "_aligned_run", fake_run({"g": 320.0}.get))
    assert timing.graph_op_us(None, FakeGraph("g", log), k=32, runs=MIN_RUNS) == 10.0
    assert log == ["g"] * MIN_RUNS
    with pytest.raises(ValueError, match="at least"):
        timing.graph_op_us(None, FakeGraph("g", log), k=32, runs=MIN_RUNS - 1)
