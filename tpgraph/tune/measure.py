"""Measure every all-reduce candidate on this machine, by the one timing method (timing.py): at each size, each
custom algorithm over a range of grid sizes and NCCL in graph mode, all graphs captured first and timed interleaved;
then in eager mode each custom algorithm at the grid graph mode chose, and NCCL, interleaved the same way. Multicast
is never measured while it is gated."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpgraph.comm.custom_ar import CustomAllReduce
from tpgraph.comm.multicast import multicast_disabled_reason
from tpgraph.comm.thresholds import Algo, useful_blocks
from tpgraph.distributed import ParallelState, gather_objects
from tpgraph.errors import CommError
from tpgraph.tune.launch import smallest_near_best
from tpgraph.tune.timing import K_OPS, MIN_RUNS, capture, eager_ops_us_interleaved, graph_ops_us_interleaved, released

# 4 KB .. 64 MB in powers of two, and from 1 MB up the midpoints too (1.5 MB, 3 MB, .. 48 MB): above the push slot
# the algorithms cross within an octave, and a band must hold two measured sizes, so a crossing between two powers
# of two would otherwise hand a size the slower algorithm (eager 32 MB: 1shot_pull 5% ahead of NCCL, alone).
DEFAULT_SIZES = tuple(sorted([4096 << i for i in range(15)] + [(3 << 19) << i for i in range(6)]))
CUSTOM = (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT)
BASE_GRIDS = (1, 2, 4, 8, 16, 32, 64)  # and one and two blocks per SM


@dataclass
class Measurement:
    mode: str  # "graph" | "eager"
    algo: str
    nbytes: int
    us: float | None  # slowest rank's median per-op time; None: the algorithm cannot take this size here
    blocks: int | None = None  # the grid it ran with (custom algorithms)
    us_by_blocks: dict[int, float] = field(default_factory=dict)  # graph mode: every grid tried
    note: str = ""


def grids_for(algo: Algo, nbytes: int, world_size: int, num_sms: int) -> list[int]:
    """Grid sizes worth trying: up to the blocks the message has work for (as the table's resolver caps them), and
    only grids the table can launch: a block count resolves to at most the SM count, so a base grid above it (64 on
    a GPU of 58 SMs) would be timed but never run; one and two blocks per SM it names as such."""
    useful = useful_blocks(algo, nbytes, world_size)
    grids = {g for g in BASE_GRIDS if g <= num_sms} | {num_sms, 2 * num_sms}
    return sorted(g for g in grids if g <= useful)


def skipped_multicast() -> str:
    reason = multicast_disabled_reason()
    return (f"2shot_multicast not measured: {reason}" if reason
            else "2shot_multicast not measured: this build never creates multicast objects")


def measure(state: ParallelState, ar: CustomAllReduce, sizes: Iterable[int] = DEFAULT_SIZES, runs: int = MIN_RUNS,
            k: int = K_OPS, progress: Callable[[str], None] | None = None) -> list[Measurement]:
    """Every candidate at every size, graph and eager. `progress(label)` is called once per grid (captured, refused
    or skipped after a refusal) and once per eager candidate (run or not): count_steps' count."""
    out: list[Measurement] = []
    tick = progress or (lambda _: None)
    for nbytes in sizes:
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=state.device)  # zeros: sums stay finite
        graph_us, notes = _graphs(state, ar, x, runs, k, tick)
        nccl = functools.partial(dist.all_reduce, x, group=state.tp_group)
        eager = {"nccl": nccl}
        for algo in CUSTOM:
            times = {blocks: us for (a, blocks), us in graph_us.items() if a == algo.value}
            if not times:
                out += [Measurement(m, algo.value, nbytes, None, note=notes[algo.value]) for m in ("graph", "eager")]
                tick(f"{algo.value} {nbytes} B eager: not run")  # (count_steps counts its eager step all the same)
                continue
            best = smallest_near_best(times)
            out.append(Measurement("graph", algo.value, nbytes, times[best], best, times))
            if algo != Algo.PUSH_1SHOT and nbytes > ar.staging_bytes:  # eager pull stages its input
                out.append(Measurement("eager", algo.value, nbytes, None, note="over the staging buffer"))
                tick(f"{algo.value} {nbytes} B eager: not run")
            else:
                eager[algo.value] = functools.partial(ar.all_reduce, x, algo, blocks=best)
        out.append(Measurement("graph", Algo.NCCL.value, nbytes, graph_us[(Algo.NCCL.value, None)]))
        eager_us = eager_ops_us_interleaved(state, eager, k, runs)
        for name, us in eager_us.items():
            blocks = None if name == Algo.NCCL.value else eager[name].keywords["blocks"]
            out.append(Measurement("eager", name, nbytes, us, blocks))
            tick(f"{name} {nbytes} B eager")
        del x
        torch.cuda.empty_cache()
    return _in_order(out)


def _graphs(state: ParallelState, ar: CustomAllReduce, x: torch.Tensor, runs: int, k: int,
            tick: Callable[[str], None]) -> tuple[dict[tuple[str, int | None], float], dict[str, str]]:
    """Graph per-op µs of every custom algorithm at every grid worth trying, and NCCL's, for x: every graph captured
    first, then all timed interleaved (so drift falls on all alike); {(algo, blocks): µs}, and why an algorithm got
    no graph."""
    nbytes = x.numel() * x.element_size()
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    keys: dict[str, tuple[str, int | None]] = {}
    notes: dict[str, str] = {}
    with released(ar) as ctx:
        try:
            for algo in CUSTOM:
                grids = grids_for(algo, nbytes, state.world_size, ar.num_sms)
                for i, blocks in enumerate(grids):
                    name = f"{algo.value}/{blocks}"
                    try:
                        graphs[name] = capture(functools.partial(ar.all_reduce, x, algo, blocks=blocks), k, ctx)
                        refused = None
                    except CommError as exc:  # more blocks than this kernel keeps resident
                        refused = str(exc)
                    # every rank must time the same graphs (their runs pair up): a refusal anywhere stops them all
                    reasons = [r for r in gather_objects(state, refused) if r]
                    if reasons:
                        graphs.pop(name, None)
                        notes[algo.value] = f"{blocks} blocks refused: {reasons[0]}"
                        for _ in grids[i:]:  # (this grid and the larger ones skipped: count_steps counts each)
                            tick(f"{algo.value} {nbytes} B, from {blocks} blocks refused")
                        break
                    keys[name] = (algo.value, blocks)
                    tick(f"{algo.value} {nbytes} B, {blocks} blocks")
                notes.setdefault(algo.value, "no grid ran")
            graphs["nccl"], keys["nccl"] = capture(functools.partial(dist.all_reduce, x, group=state.tp_group), k), (
                Algo.NCCL.value, None)
            times = graph_ops_us_interleaved(state, graphs, k, runs)
        finally:
            graphs.clear()  # before their registrations are given back
    return {keys[name]: us for name, us in times.items()}, notes


def _in_order(out: list[Measurement]) -> list[Measurement]:
    """Per size: each custom algorithm's graph then eager figure, then NCCL's (the log's order)."""
    rank = {a: i for i, a in enumerate([a.value for a in CUSTOM] + [Algo.NCCL.value])}
    return sorted(out, key=lambda m: (m.nbytes, rank[m.algo], m.mode != "graph"))


def count_steps(sizes: Iterable[int], world_size: int, num_sms: int) -> int:
    """How many progress ticks measure() makes (for the progress bar)."""
    total = 0
    for nbytes in sizes:
        total += 1  # NCCL
        for algo in CUSTOM:
            total += len(grids_for(algo, nbytes, world_size, num_sms)) + 1
    return total
