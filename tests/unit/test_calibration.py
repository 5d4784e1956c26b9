"""Prefill calibration: which token counts run eagerly rather than padded to their graph."""

import pytest

from tpgraph.errors import ConfigError
from tpgraph.graphs.calibration import SizeTiming, describe_counts, eager_counts, slowest, time_forward
from tpgraph.graphs.dispatcher import BatchDescriptor, Dispatcher, GraphMode


def ms(size, eager, graph):
    return SizeTiming(size, eager / 1e3, graph / 1e3)


# Session 43's H200 figures at TP=1 (bench/results/2026-12-05_h200_s43): eager forwards wait on the host below ~800
# tokens; near 1024 the GPU's work hides the launches, and padding costs more than the graph saves.
H200 = [ms(512, 21.0, 13.3), ms(640, 21.5, 16.7), ms(768, 21.8, 20.1), ms(896, 23.3, 22.8), ms(1024, 26.9, 25.6)]


def brute_force(timings, n):
    """Eager for n? Independent of eager_counts' loop: the first size holding n, the eager line through its
    neighbours."""
    order = sorted(timings, key=lambda t: t.size)
    i = next(i for i, t in enumerate(order) if t.size >= n)
    b = order[i]
    if i == 0:
        return b.eager_s < b.graph_s
    a = order[i - 1]
    eager = a.eager_s + (b.eager_s - a.eager_s) * (n - a.size) / (b.size - a.size)
    return eager < b.graph_s


def test_host_bound_sizes_always_take_their_graph():
    counts = set(eager_counts(H200))
    assert not counts & set(range(1, 769))  # 517 tokens padded to 640: 16.7 ms against ~21 ms eager


def test_gpu_bound_counts_just_past_a_size_run_eagerly():
    counts = set(eager_counts(H200))
    # 900 tokens: ~23.4 ms eagerly against 25.6 ms padded to 1024; 1000: ~26.2 ms against 25.6, so the graph
    assert 900 in counts and 1000 not in counts and 1024 not in counts
    # 770 tokens: ~21.8 ms eagerly against 22.8 ms padded to 896
    assert 770 in counts and 896 not in counts
    assert counts == {n for n in range(1, 1025) if brute_force(H200, n)}


def test_a_size_its_graph_cannot_beat_runs_eagerly_throughout():
    timings = [ms(16, 5.0, 2.0), ms(32, 5.0, 6.0)]  # (say, a graph replay slowed by its attention splits)
    assert eager_counts(timings) == tuple(range(17, 33))
    assert eager_counts([ms(16, 1.0, 2.0)]) == tuple(range(1, 17))  # the smallest: eager as timed at its size
    assert eager_counts([]) == ()


def test_order_of_timings_does_not_matter():
    assert eager_counts(list(reversed(H200))) == eager_counts(H200)


def test_slowest_takes_each_figure_from_its_slowest_rank():
    rank0 = [ms(16, 5.0, 1.0), ms(32, 4.0, 3.0)]
    rank1 = [ms(16, 4.0, 2.0), ms(32, 6.0, 2.0)]
    assert slowest([rank0, rank1]) == [ms(16, 5.0, 2.0), ms(32, 6.0, 3.0)]
    with pytest.raises(ConfigError, match="different prefill sizes"):
        slowest([rank0, rank1[:1]])


def test_time_forward_takes_the_median_of_synced_runs():
    calls, syncs = [], []
    delays = iter([0.0, 0.03, 0.0, 0.001])  # warm-up, then three timed runs: the median is the 1 ms one

    def run():
        import time
        calls.append(1)
        time.sleep(next(delays))

    t = time_forward(run, lambda: syncs.append(1), reps=3)
    assert len(calls) == 4 and len(syncs) == 6  # one warm-up untimed; each timed run synced before and after
    assert 0.0009 < t < 0.02
    with pytest.raises(ConfigError, match="reps"):
        time_forward(run, lambda: None, reps=0)


def test_describe_counts():
    assert describe_counts([900, 770, 771, 772, 899, 5]) == "5, 770-772, 899-900"
    assert describe_counts(()) == "none"


def test_dispatcher_runs_eager_counts_unpadded():
    d = Dispatcher((), (16, 64), eager_counts=range(40, 50))
    assert d.dispatch(39, 1, False) == (GraphMode.PIECEWISE, BatchDescriptor(64, 1, 39, False))
    assert d.dispatch(40, 2, False) == (GraphMode.NONE, BatchDescriptor(40, 2, 40, False))
    assert d.dispatch(49, 1, False)[0] is GraphMode.NONE
    assert d.dispatch(50, 1, False)[0] is GraphMode.PIECEWISE
    assert d.padded_size(45, GraphMode.PIECEWISE) == 64  # (what it would pad to, were it padded)
    assert d.eager_counts == tuple(range(40, 50))
    assert "eager_counts=40-49" in repr(d)
    with pytest.raises(ConfigError, match=r"eager counts \[65\] are outside the piecewise sizes \(1..64\)"):
        Dispatcher((), (16, 64), eager_counts=[65])
    with pytest.raises(ConfigError, match="outside"):
        Dispatcher((1, 2), (), eager_counts=[1])
