"""PeerWatch on a fake store: a stalled peer, a failing store and a frozen store each end the watch, named."""

import threading
import time

from tpgraph.distributed import ParallelState
from tpgraph.engine.liveness import PeerWatch


class DictStore:
    def __init__(self):
        self.data, self.frozen, self.broken = {}, threading.Event(), False

    def set(self, key, value):
        if self.broken:
            raise RuntimeError("connection reset by peer")
        while self.frozen.is_set():
            time.sleep(0.01)
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def state(rank, world=2):
    return ParallelState(rank, world, rank, None, None, None)


def watch(rank, store, deaths):
    # (a 2 s timeout at 20 beats a second: under a loaded parallel test run a beat thread can wait its turn for
    # a few hundred ms, which a 0.5 s timeout would call a death)
    return PeerWatch(state(rank), interval_s=0.05, timeout_s=2.0, on_dead=deaths.append, store=store)


def wait_for(deaths, seconds=10.0):
    end = time.monotonic() + seconds
    while not deaths and time.monotonic() < end:
        time.sleep(0.02)
    return deaths


def test_a_stalled_peer_is_named():
    store, deaths = DictStore(), []
    w0, w1 = watch(0, store, deaths), watch(1, store, [])
    assert w0.start() and w1.start()
    time.sleep(0.3)
    assert not deaths  # both beating
    w1.stop()  # rank 1 goes quiet
    assert "rank 1 stopped answering" in wait_for(deaths)[0]
    w0.stop()


def test_a_failing_or_frozen_store_names_rank_0():
    store, deaths = DictStore(), []
    w1 = watch(1, store, deaths)
    store.data["tpgraph/heartbeat/0"] = b"1"
    w1.start()
    store.broken = True
    assert "lost the process group's store (hosted by rank 0)" in wait_for(deaths)[0]
    w1.stop()
    store2, deaths2 = DictStore(), []
    w = watch(1, store2, deaths2)
    w.start()
    store2.frozen.set()
    assert "has not answered" in wait_for(deaths2)[0]
    store2.frozen.clear()
    w.stop()


def test_single_rank_or_no_store_watches_nothing():
    assert not PeerWatch(state(0, 1), store=DictStore()).start()


def test_a_peer_that_never_beat_is_named_not_a_healthy_one():
    """Three ranks; rank 2 dies before its first beat. Rank 1 beats all along, yet it was the one named: the store
    was read only once every peer's key was there, so no peer's beats were seen, and the first peer timed out."""
    store, deaths = DictStore(), []
    w0 = PeerWatch(state(0, 3), interval_s=0.05, timeout_s=1.0, on_dead=deaths.append, store=store)
    w1 = PeerWatch(state(1, 3), interval_s=0.05, timeout_s=60.0, on_dead=lambda _: None, store=store)
    assert w0.start() and w1.start()
    try:
        assert "rank 2 stopped answering" in wait_for(deaths)[0], deaths
    finally:
        w0.stop()
        w1.stop()


def test_a_watch_stopped_from_its_own_thread_returns():
    """An engine dropped unclosed can be freed on the watch's thread, whose finalizer then stops the watch there: a
    join of the current thread raised, before the started ranks were ended. (Here the stop comes from on_dead, which
    the watch's thread calls for a peer that never beats.)"""
    deaths = []
    w = watch(0, DictStore(), deaths)
    w.on_dead = lambda message: (w.stop(), deaths.append(message))
    w.start()
    assert wait_for(deaths), "stop() from the watch's own thread raised before on_dead finished"
