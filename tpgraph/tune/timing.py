"""The one timing method for all-reduce candidates, fixed before any number is looked at (the tuner and
bench/bench_allreduce.py use it alike, for ours, NCCL and symm_mem):

- graph: K ops captured in one CUDA graph (K = 64, the all-reduces of one Llama-3-8B decode step); per-op time
  T(K) / K;
- eager: K calls issued back to back; per-op time T(K) / K (launch costs included: eager users pay them);
- every timed run (`_aligned_run`) starts with the ranks aligned by a CPU barrier, then the same GPU sleep queued
  ahead of the start event on every rank, so the host's submission is hidden, then a one-element NCCL all-reduce
  after the sleep, so the GPUs start together: a CPU barrier releases the ranks tens of µs apart, which a graph of
  2 µs ops would otherwise count as its own time on the rank that waits; CUDA events around the one replay (or the
  K eager calls);
- the median of at least 20 runs per rank, and the slowest rank's median is the figure.

One candidate (`graph_op_us`) gets its runs back to back. Several candidates compared with each
other (`graph_ops_us_interleaved`, `eager_ops_us_interleaved`: what the tuner and bench_allreduce use) get them
interleaved: in round r every graph gets one run, in an order from a Williams design (`round_order`), so slow drift
of the machine (clocks, other work) falls on all of them alike, and no candidate always runs first in a round or
always after the same other candidate; then each candidate's median per rank and the slowest rank's median per
candidate (one gather for all), exactly as for one. The pure part, the order and the medians, is
`round_order` and `interleaved_medians`; `slowest_per_candidate` takes the ranks' figures.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

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


def _check_runs(runs: int) -> None:
    if runs < MIN_RUNS:
        raise ValueError(f"the timing method takes the median of at least {MIN_RUNS} runs, got {runs}")


def _alignment_token(state: ParallelState | None) -> torch.Tensor | None:
    """The one-element tensor the GPUs align on; None where there is one rank (no barrier, no all-reduce)."""
    return torch.zeros(1, device="cuda") if state is not None and state.world_size > 1 else None


def _aligned_run(state: ParallelState | None, body: Callable[[], None], token: torch.Tensor | None) -> float:
    """µs of one `body` between CUDA events, after a CPU barrier, the same GPU sleep and (token given) a one-element
    NCCL all-reduce that releases the GPUs together. Every rank must make the same calls in the same order."""
    torch.cuda.synchronize()
    if token is not None:
        dist.barrier(group=state.cpu_group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    if token is not None:  # the GPUs leave this together, whenever each host got here
        dist.all_reduce(token, group=state.tp_group)
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _aligned_runs(state: ParallelState | None, body: Callable[[], None], runs: int) -> list[float]:
    """µs of `body`, `runs` aligned runs back to back (state None: this process alone, no barrier)."""
    _check_runs(runs)
    token = _alignment_token(state)
    return [_aligned_run(state, body, token) for _ in range(runs)]


def _williams_row(n: int) -> list[int]:
    """0, 1, n-1, 2, n-2, ...: the first row of a Williams design (shifted by r, row r; see round_order)."""
    row, lo, hi = [0], 1, n - 1
    while len(row) < n:
        row.append(lo)
        lo += 1
        if len(row) < n:
            row.append(hi)
            hi -= 1
    return row


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The order of the candidates in round r, from a Williams design: over each whole period from round 0 (n rounds;
    2n where n is odd, the second n reversed) each candidate takes each position equally often and follows each
    other candidate equally often (a partial last period is close to that), so neither a fixed slot in the round nor
    a fixed predecessor (what the kernel before left in the caches and buffers) can favour one candidate."""
    n = len(names)
    if n == 0:
        return []
    row = [(c + r) % n for c in _williams_row(n)]
    if n % 2 and (r // n) % 2:
        row.reverse()
    return [names[c] for c in row]


def interleaved_medians(names: Sequence[str], runs: int, run_one: Callable[[str], float],
                        per: int = 1) -> dict[str, float]:
    """`runs` rounds, each calling run_one(name) once per candidate in `round_order`; each candidate's median of
    its `runs` samples, divided by `per` ops. Pure given run_one (the CPU tests drive it with a fake)."""
    _check_runs(runs)
    if len(set(names)) != len(names):
        raise ValueError(f"candidate names repeat: {list(names)}")
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(runs):
        for name in round_order(names, r):
            samples[name].append(run_one(name))
    return {name: statistics.median(xs) / per for name, xs in samples.items()}


def slowest_per_candidate(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each candidate's slowest figure over the ranks' {candidate: figure} (every rank must have timed the same
    candidates, in the same order)."""
    names = list(per_rank[0])
    for rank, figures in enumerate(per_rank):
        if list(figures) != names:
            raise ValueError(f"rank {rank} timed {list(figures)}, rank 0 {names}")
    return {name: _slowest(figures[name] for figures in per_rank) for name in names}


def _slowest(figures: Iterable[float]) -> float:
    """The largest figure, a NaN (a rank with no figure) counting as inf: max() kept whichever came first of a NaN
    and a number, so the result depended on which rank it was. (inf downstream: not measured.)"""
    return max(math.inf if f != f else f for f in figures)


def slowest_median(state: ParallelState | None, samples: list[float], per: int = 1) -> float:
    """The slowest rank's median, divided by `per` ops (state None: this process's)."""
    mine = statistics.median(samples) / per
    return mine if state is None else _slowest(gather_objects(state, mine))


def graph_op_us(state: ParallelState | None, graph: torch.cuda.CUDAGraph, k: int = K_OPS,
                runs: int = MIN_RUNS) -> float:
    """Per-op µs of a captured graph of k ops, its runs back to back."""
    return slowest_median(state, _aligned_runs(state, graph.replay, runs), k)


def graph_ops_us_interleaved(state: ParallelState | None, graphs: Mapping[str, torch.cuda.CUDAGraph],
                             k: int = K_OPS, runs: int = MIN_RUNS) -> dict[str, float]:
    """Per-op µs of each captured graph of k ops, {name: µs}, timed interleaved: `runs` rounds, each one aligned
    run of every graph in `round_order`; per rank each graph's median; then the slowest rank's median per graph
    (one gather for all). Every rank must pass the same names in the same order (the runs' collectives pair up)."""
    return _bodies_us_interleaved(state, {name: graph.replay for name, graph in graphs.items()}, k, runs)


def eager_ops_us_interleaved(state: ParallelState | None, fns: Mapping[str, Callable[[], object]], k: int = K_OPS,
                             runs: int = MIN_RUNS) -> dict[str, float]:
    """Per-op µs of k eager calls of each fn issued back to back, {name: µs}, timed interleaved as
    `graph_ops_us_interleaved` times graphs (each fn called once first, as a warm-up)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()

    def calls(fn: Callable[[], object]) -> Callable[[], None]:
        def body() -> None:
            for _ in range(k):
                fn()

        return body

    return _bodies_us_interleaved(state, {name: calls(fn) for name, fn in fns.items()}, k, runs)


def _bodies_us_interleaved(state: ParallelState | None, bodies: Mapping[str, Callable[[], None]], per: int,
                           runs: int) -> dict[str, float]:
    _check_runs(runs)
    if state is not None and state.world_size > 1:  # the runs' collectives pair up only if every rank times the same
        names = gather_objects(state, list(bodies))
        if any(n != names[0] for n in names):
            raise RuntimeError(f"ranks would time different candidates: {names}")
    token = _alignment_token(state)
    mine = interleaved_medians(list(bodies), runs, lambda name: _aligned_run(state, bodies[name], token), per)
    return mine if state is None else slowest_per_candidate(gather_objects(state, mine))


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
