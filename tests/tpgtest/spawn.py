"""Run a function on N CPU ranks (gloo) in fresh processes and collect what each returns."""

from __future__ import annotations

import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, fn: Callable, args: tuple, workdir: str) -> None:
    init = f"file://{workdir}/init"
    result = fn(rank, world_size, init, *args)
    Path(workdir, f"result{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """fn(rank, world_size, init_method, *args) on every rank; returns the ranks' results in order.

    A worker's exception fails the call (torch.multiprocessing re-raises it here)."""
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(_entry, args=(world_size, fn, args, workdir), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks still running after {timeout_s:.0f}s (a hang)")
        return [pickle.loads(Path(workdir, f"result{r}.pkl").read_bytes()) for r in range(world_size)]
