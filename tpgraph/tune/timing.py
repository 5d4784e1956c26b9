"""The one timing method for all-reduce candidates, fixed before any number is looked at (the tuner and
bench/bench_allreduce.py use it alike, for ours, NCCL and symm_mem):

- graph: K ops captured in one CUDA graph (K = 64, the all-reduces of one Llama-3-8B decode step); per-op time
  T(K) / K;
- eager: K calls issued back to back; per-op time T(K) / K (launch costs included: eager users pay them);
- every timed run starts with the ranks aligned by a barrier, then the same GPU sleep queued ahead of the start
  event on every rank, so the host's submission is hidden, then a one-element NCCL all-reduce after the sleep, so
  the GPUs start together: a CPU barrier releases the ranks tens of µs apart, which a graph of 2 µs ops would
  otherwise count as its own time on the rank that waits;
- the median of at least 20 runs per rank, and the slowest rank's median is the figure.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from tpgraph.distributed import ParallelState, gather_objects

K_OPS = 64
MIN_RUNS = 20
SLEEP_CYCLES = 200_000  # about 100 µs on an H200: longer than the host takes to submit a replay


def capture(fn: Callable[[], object], k: int = K_OPS,
            capture_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
            ) -> torch.cuda.CUDAGraph:
    """A graph of k calls of fn (one eager call first, outside capture, as a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture_ctx(), torch.cuda.graph(graph):
        for _ in range(k):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _aligned_runs(state: ParallelState | None, body: Callable[[], None], runs: int) -> list[float]:
    """µs of `body` between CUDA events, `runs` times, each after a barrier and the same GPU sleep (state None: this
    process alone, no barrier)."""
    if runs < MIN_RUNS:
        raise ValueError(f"the timing method takes the median of at least {MIN_RUNS} runs, got {runs}")
    out = []
    ranks = state is not None and state.world_size > 1
    token = torch.zeros(1, device="cuda") if ranks else None
    for _ in range(runs):
        torch.cuda.synchronize()
        if ranks:
            dist.barrier(group=state.cpu_group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        if ranks:  # the GPUs leave this together, whenever each host got here
            dist.all_reduce(token, group=state.tp_group)
        start.record()
        body()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def slowest_median(state: ParallelState | None, samples: list[float], per: int = 1) -> float:
    """The slowest rank's median, divided by `per` ops (state None: this process's)."""
    mine = statistics.median(samples) / per
    return mine if state is None else max(gather_objects(state, mine))


def graph_op_us(state: ParallelState | None, graph: torch.cuda.CUDAGraph, k: int = K_OPS,
                runs: int = MIN_RUNS) -> float:
    """Per-op µs of a captured graph of k ops."""
    return slowest_median(state, _aligned_runs(state, graph.replay, runs), k)


def eager_op_us(state: ParallelState | None, fn: Callable[[], object], k: int = K_OPS, runs: int = MIN_RUNS) -> float:
    """Per-op µs of k eager calls issued back to back."""
    fn()  # warm-up
    torch.cuda.synchronize()

    def body() -> None:
        for _ in range(k):
            fn()

    return slowest_median(state, _aligned_runs(state, body, runs), k)


@contextlib.contextmanager
def released(ar) -> Iterator[Callable[[], contextlib.AbstractContextManager]]:
    """A capture context for the custom all-reduce whose registrations are handed back when the block ends (a
    tuner captures hundreds of graphs; each would otherwise keep its pointer-table rows). ar None: a plain one.
    Drop the block's graphs inside it, before their registrations go."""
    if ar is None:
        yield contextlib.nullcontext
        return
    registrations = []

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        with ar.capture() as registration:
            registrations.append(registration)
            yield

    try:
        yield ctx
    finally:
        torch.cuda.synchronize()
        for registration in registrations:
            ar.release_registration(registration)
