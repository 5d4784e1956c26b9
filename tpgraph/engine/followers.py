"""Ranks 1..N-1 started by TPEngine itself, for `TPEngine(tp_size=N)` in a plain Python process (no torchrun).

Each follower builds the same engine and obeys rank 0's messages (control.py) until rank 0 says shut down. They are
daemon processes of the user's process: they go when it exits, and their peer watch ends them if it dies.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tpgraph.errors import ConfigError


def free_tcp_init() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def cpu_threads_per_rank(world_size: int) -> int | None:
    """Threads for each of `world_size` CPU ranks on this host: its cores shared out, as torchrun shares them (it sets
    OMP_NUM_THREADS=1); None where the user set OMP_NUM_THREADS. Every rank at torch's default took every core, and
    TP=2 on two cores ran 10x slower than under torchrun."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


JOIN_WAIT_S = 600.0  # (as long as the process group's rendezvous waited for a rank that never came)
# a follower told to stop by a signal (one its whole process group got) waits this long for rank 0's shutdown message
FOLLOWER_GRACE_S = 8.0


def leave_later_on(*signals: signal.Signals) -> None:
    """On any of `signals`, end this process FOLLOWER_GRACE_S later (exit code 0), unless it has ended by then."""
    def leave_later(*_: object) -> None:
        timer = threading.Timer(FOLLOWER_GRACE_S, os._exit, (0,))
        timer.daemon = True
        timer.start()

    for sig in signals:
        signal.signal(sig, leave_later)


def follower_main(rank: int, world_size: int, init: str, kwargs: dict[str, Any],
                  started: multiprocessing.connection.Connection, threads: int | None = None,
                  setup: Callable[[], None] | None = None) -> None:
    started.send("started")  # (reached once the spawned interpreter has imported the user's main module)

    def joining() -> None:  # (its own checks passed: it joins the rendezvous now, and so can rank 0)
        started.send("joining")
        started.close()

    if threads is not None:  # (a CPU rank's share of the cores: cpu_threads_per_rank)
        import torch

        torch.set_num_threads(threads)
    # Ctrl-C in a terminal reaches the whole process group: rank 0 handles it and tells the followers to stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # so does a SIGTERM sent to the group (systemd's stop, kill -TERM -PGID): leaving at once stranded rank 0 in a
    # step's collectives (its engine loop failed), so this rank follows until rank 0 says stop, and leaves by itself if
    # that is late. (Rank 0 ends a rank it means to end at once with SIGKILL.)
    leave_later_on(signal.SIGTERM)
    from tpgraph.engine.tp_engine import TPEngine
    from tpgraph.errors import TPGraphError

    try:
        if setup is not None:  # (rank 0's logging: TPEngine's rank_setup)
            setup()
        engine = TPEngine(dist_init=(rank, world_size, init), follower=joining, **kwargs)
    except TPGraphError as exc:  # rank 0 raises the same error (run_on_all_ranks); say it once, quietly
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        sys.exit(2)
    with engine:
        engine.follow()


def start_followers(world_size: int, init: str, kwargs: dict[str, Any], threads: int | None = None,
                    setup: Callable[[], None] | None = None) -> list[multiprocessing.Process]:
    """Ranks 1..world_size-1, each once it has started (reached follower_main) and passed its own checks, about to join
    the process group (follower_main's joining). A rank that dies first is a ConfigError naming it, the others ended:
    before it started, a script that makes its TPEngine with no `if __name__ == "__main__":` guard (the spawned rank
    runs the script again and multiprocessing refuses the nested start); after, a check of its own (no GPU for it).
    Rank 0 would otherwise wait for it in the process group's rendezvous until that times out. `threads`: each
    rank's torch threads (CPU ranks: cpu_threads_per_rank). `setup` (picklable: spawn sends it): what each runs
    before it builds its engine."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world_size)]  # (rank i's is pipes[i - 1])
    procs = [ctx.Process(target=follower_main, daemon=True, name=f"tpgraph-rank-{rank}",
                         args=(rank, world_size, init, kwargs, pipes[rank - 1][1], threads, setup))
             for rank in range(1, world_size)]
    try:
        for p in procs:
            p.start()
        for _, send in pipes:
            send.close()  # (the children hold their ends: a child that dies closes its pipe)
        waiting = {pipes[rank - 1][0]: (rank, procs[rank - 1]) for rank in range(1, world_size)}
        begun: set[int] = set()  # ranks that told they started (past the import of the user's main module)
        deadline = time.monotonic() + JOIN_WAIT_S
        while waiting:
            ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(rank for rank, _ in waiting.values())
                raise ConfigError(f"rank(s) {late}, started by TPEngine(tp_size={world_size}), did not reach the "
                                  f"process group in {JOIN_WAIT_S:.0f} s")
            for recv in ready:
                rank, p = waiting[recv]
                try:
                    said = recv.recv()
                except EOFError:
                    p.join(5.0)
                    if rank in begun:  # (its own checks failed: a GPU of its own, ...)
                        raise ConfigError(
                            f"rank {rank}, started by TPEngine(tp_size={world_size}), exited (code {p.exitcode}) "
                            f"before it joined the process group (its error is above)") from None
                    raise ConfigError(
                        f"rank {rank}, started by TPEngine(tp_size={world_size}), exited (code {p.exitcode}) before it "
                        f"started (its error is above): a script that makes a TPEngine with tp_size > 1 outside "
                        f"torchrun must do so under `if __name__ == \"__main__\":`, since each started rank imports "
                        f"the script again (multiprocessing's spawn)") from None
                if said == "started":
                    begun.add(rank)
                else:  # ("joining": rank 0 joins it in the rendezvous)
                    del waiting[recv]
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()  # (a follower defers SIGTERM: follower_main)
        for p in procs:
            if p.pid is not None:
                p.join(5.0)
        raise
    finally:
        for recv, _ in pipes:
            recv.close()
    return procs
