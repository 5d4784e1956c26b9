"""Run a function on N CPU ranks (gloo) in fresh processes and collect what each returns."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, call: bytes, workdir: str, env: dict[str, str], cwd: str) -> None:
    # forked from the fork server, which holds the environment and directory of its own start: take the caller's, and
    # only then unpickle the call (which imports fn's module: a variable read at its import sees the caller's value)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn, args = pickle.loads(call)
    init = f"file://{workdir}/init"
    result = fn(rank, world_size, init, *args)
    Path(workdir, f"result{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """fn(rank, world_size, init_method, *args) on every rank; returns the ranks' results in order.

    A worker's exception fails the call (torch.multiprocessing re-raises it here). The ranks fork from a server that
    imported torch once: spawned, each rank's import of torch was most of the CPU the multi-rank tests took."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch"])
    with tempfile.TemporaryDirectory() as workdir:
        call = pickle.dumps((fn, args))
        ctx = mp.start_processes(_entry, args=(world_size, call, workdir, dict(os.environ), os.getcwd()),
                                 nprocs=world_size, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks still running after {timeout_s:.0f}s (a hang)")
        return [pickle.loads(Path(workdir, f"result{r}.pkl").read_bytes()) for r in range(world_size)]


def run_ranks_in_subprocess(worker: str, world_size: int, *args, timeout_s: float = 120.0
                            ) -> subprocess.CompletedProcess:
    """run_ranks(tpgtest.workers.<worker>, world_size, *args) in a fresh interpreter, for workers whose CUDA
    context dies (a trapped kernel): they report through files and exit hard, so only their output comes back."""
    code = ("import sys; sys.path.insert(0, 'tests'); from tpgtest.spawn import run_ranks; "
            f"from tpgtest.workers import {worker}; "
            f"run_ranks({worker}, {world_size}, *{args!r}, timeout_s={timeout_s})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s + 30,
                          cwd=Path(__file__).resolve().parents[2])
