"""Ranks 1..N-1 started by TPEngine itself, for `TPEngine(tp_size=N)` in a plain Python process (no torchrun).

Each follower builds the same engine and obeys rank 0's messages (control.py) until rank 0 says shut down. They are
daemon processes of the user's process: they go when it exits, and their peer watch ends them if it dies.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
import sys
from typing import Any


def free_tcp_init() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def follower_main(rank: int, world_size: int, init: str, kwargs: dict[str, Any]) -> None:
    # Ctrl-C in a terminal reaches the whole process group: rank 0 handles it and tells the followers to stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tpgraph.engine.tp_engine import TPEngine
    from tpgraph.errors import TPGraphError

    try:
        engine = TPEngine(dist_init=(rank, world_size, init), follower=True, **kwargs)
    except TPGraphError as exc:  # rank 0 raises the same error (run_on_all_ranks); say it once, quietly
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        sys.exit(2)
    with engine:
        engine.follow()


def start_followers(world_size: int, init: str, kwargs: dict[str, Any]) -> list[multiprocessing.Process]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(rank, world_size, init, kwargs), daemon=True,
                         name=f"tpgraph-rank-{rank}") for rank in range(1, world_size)]
    for p in procs:
        p.start()
    return procs
