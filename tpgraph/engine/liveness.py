"""Peer liveness: a rank that dies or stops answering takes every other rank down within seconds, with its name.

Without this, a peer frozen with SIGSTOP leaves the others blocked in a collective until the process group's timeout
(600 s), and then they die with a raw traceback. Here every rank bumps a counter in the process group's key-value
store once a second from a daemon thread, and watches the others' counters. A counter that stops moving for
`timeout_s`, or a store that stops answering (it lives on rank 0), ends this process with a message naming the rank.
The step path is untouched: nothing here waits on a GPU or a collective.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from tpgraph.distributed import ParallelState

logger = logging.getLogger(__name__)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _exit_now(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    logger.error("%s", message)
    os._exit(1)


class PeerWatch:
    def __init__(self, state: ParallelState, interval_s: float = 1.0, timeout_s: float = 10.0,
                 on_dead: Callable[[str], None] = _exit_now, store=None) -> None:
        self.state, self.interval_s, self.timeout_s, self.on_dead = state, interval_s, timeout_s, on_dead
        self.store = store if store is not None else _default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_round = time.monotonic()  # when the store last answered a whole round

    def start(self) -> bool:
        if self.state.world_size == 1 or self.store is None:
            return False
        self._thread = threading.Thread(target=self._run, name="tpgraph-peer-watch", daemon=True)
        self._thread.start()
        # a frozen store host blocks store calls instead of failing them: a second thread times the rounds
        threading.Thread(target=self._guard, name="tpgraph-peer-watch-guard", daemon=True).start()
        return True

    def _guard(self) -> None:
        while not self._stop.wait(self.interval_s):
            stalled = time.monotonic() - self._last_round
            if stalled > self.timeout_s:
                self._stop.set()
                self.on_dead(f"rank {self.state.rank}: the process group's store (hosted by rank 0) has not answered "
                             f"for {stalled:.0f} s: rank 0 died or stopped answering; exiting")
                return

    def stop(self) -> None:
        self._stop.set()
        # (not from the watch itself: an engine freed on its thread stops it from there)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s)

    def _key(self, rank: int) -> str:
        return f"tpgraph/heartbeat/{rank}"

    def _run(self) -> None:
        me, world = self.state.rank, self.state.world_size
        peers = [r for r in range(world) if r != me]
        seen: dict[int, tuple[bytes | None, float]] = {r: (None, time.monotonic()) for r in peers}
        beat = 0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(self._key(me), str(beat))
                # each peer's key on its own (a get of one not set yet would wait): one that never beat is named,
                # not whichever peer comes first while the others beat on unread
                values = {r: self.store.get(self._key(r)) for r in peers if self.store.check([self._key(r)])}
            except Exception as exc:  # the store is hosted by rank 0: it is gone or frozen
                if self._stop.is_set():
                    return
                self._stop.set()
                self.on_dead(f"rank {me}: lost the process group's store (hosted by rank 0): {exc}; rank 0 died or "
                             f"stopped answering, exiting")
                return
            self._last_round = time.monotonic()
            for r in peers:
                value = values.get(r)
                last, since = seen[r]
                if value is not None and value != last:
                    seen[r] = (value, now)
                elif now - since > self.timeout_s:
                    self._stop.set()
                    self.on_dead(f"rank {me}: rank {r} stopped answering (no heartbeat for "
                                 f"{now - since:.0f} s: killed, frozen or hung); exiting")
                    return
            self._stop.wait(self.interval_s)
