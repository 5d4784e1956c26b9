"""The tuner's measurement plan, with the GPU parts faked: every candidate's graph at a size is timed in one
interleaved call, eager candidates in another, and the results land as Measurements."""

import contextlib
import types

import pytest
import torch

from tpgraph.comm.thresholds import Algo
from tpgraph.errors import CommError
from tpgraph.tune import measure as m

MB = 1 << 20


class FakeAR:
    num_sms = 132
    push_slot_bytes = 16 * MB
    staging_bytes = 4 * MB

    def all_reduce(self, x, algo, blocks=None):
        if blocks and blocks > self.num_sms:  # as the extension refuses grids it cannot keep resident
            raise CommError("too many blocks")
        return x


@pytest.fixture
def faked(monkeypatch):
    calls = {"graph": [], "eager": []}

    def graph_times(state, graphs, k, runs):
        calls["graph"].append(list(graphs))
        return {name: 10.0 if name == "nccl" else 1.0 + int(name.split("/")[1]) / 1000 for name in graphs}

    def eager_times(state, fns, k, runs):
        calls["eager"].append(list(fns))
        return {name: 20.0 for name in fns}

    monkeypatch.setattr(m, "capture", lambda fn, k, ctx=contextlib.nullcontext: (fn(), object())[1])
    monkeypatch.setattr(m, "released", lambda ar: contextlib.nullcontext(contextlib.nullcontext))
    monkeypatch.setattr(m, "graph_ops_us_interleaved", graph_times)
    monkeypatch.setattr(m, "eager_ops_us_interleaved", eager_times)
    monkeypatch.setattr(m.dist, "all_reduce", lambda x, group=None: None)
    monkeypatch.setattr(m, "gather_objects", lambda state, obj: [obj, obj])  # two ranks that agree
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return calls


def test_one_interleaved_call_per_size_and_mode(faked):
    state = types.SimpleNamespace(device="cpu", world_size=2, tp_group=None)
    sizes = [4096, 32 * MB]
    out = m.measure(state, FakeAR(), sizes, runs=20)
    assert len(faked["graph"]) == len(faked["eager"]) == len(sizes)
    small, large = faked["graph"]
    assert "nccl" in small and any(n.startswith("1shot_push/") for n in small)
    assert any(n.startswith("1shot_push/") for n in large)  # over the push slot: pieces, measured as the product runs
    assert faked["eager"][1] == ["nccl", "1shot_push"]  # at 32 MB the pulls stage over the staging buffer
    graph = {(x.algo, x.nbytes): x for x in out if x.mode == "graph"}
    assert graph[("1shot_push", 4096)].blocks == min(m.grids_for(Algo.PUSH_1SHOT, 4096, 2, 132))  # fewest is fastest
    assert graph[("1shot_push", 32 * MB)].us is not None
    assert graph[("nccl", 32 * MB)].us == 10.0
    eager = {(x.algo, x.nbytes): x for x in out if x.mode == "eager"}
    assert eager[("2shot_pull", 32 * MB)].note == "over the staging buffer"
    assert eager[("1shot_pull", 4096)].us == 20.0 and eager[("1shot_pull", 4096)].blocks is not None
    # every algorithm has one graph and one eager figure per size, in the log's order
    assert [(x.algo, x.mode) for x in out if x.nbytes == 4096] == [
        (a, mode) for a in ("1shot_push", "1shot_pull", "2shot_pull", "nccl") for mode in ("graph", "eager")]


def test_a_grid_refused_on_one_rank_stops_that_algorithm_on_every_rank(faked, monkeypatch):
    """The other rank's refusal arrives through the gather: this rank must not time graphs the other lacks."""
    state = types.SimpleNamespace(device="cpu", world_size=2, tp_group=None)

    seen = []

    def gather(state, refused):  # this rank never refuses; the other refuses the third push grid
        seen.append(refused)
        return [refused, "rank 1: too many blocks" if len(seen) == 3 else None]

    monkeypatch.setattr(m, "gather_objects", gather)
    out = m.measure(state, FakeAR(), [4096], runs=20)
    pushes = [n for n in faked["graph"][0] if n.startswith("1shot_push/")]
    assert len(pushes) == 2  # the third grid was refused elsewhere: no rank times it or any larger one
    graph = {x.algo: x for x in out if x.mode == "graph"}
    assert graph["1shot_push"].us is not None


def test_the_progress_ticks_are_as_many_as_count_steps_says_when_grids_are_refused(faked):
    """The bar's total (count_steps) counted every grid and an eager run per algorithm, but a refused grid stopped
    its algorithm's later grids, and an algorithm with none ran no eager step: the bar ended short of its total."""
    class NoPull1(FakeAR):  # refuses 1shot_pull at every grid, and (as FakeAR) grids over its SMs
        def all_reduce(self, x, algo, blocks=None):
            if algo == Algo.PULL_1SHOT:
                raise CommError("no 1shot_pull here")
            return super().all_reduce(x, algo, blocks)

    state = types.SimpleNamespace(device="cpu", world_size=2, tp_group=None)
    sizes = [4096, 32 * MB]
    ticks = []
    m.measure(state, NoPull1(), sizes, runs=20, progress=ticks.append)
    assert len(ticks) == m.count_steps(sizes, 2, FakeAR.num_sms)
