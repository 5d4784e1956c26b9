"""Measure every all-reduce candidate on this machine, by the one timing method (timing.py): each custom algorithm
at every size over a range of grid sizes in graph mode, then in eager mode at the grid graph mode chose; NCCL at
every size in both modes. Multicast is never measured while it is gated."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpgraph.comm.custom_ar import CustomAllReduce
from tpgraph.comm.multicast import multicast_disabled_reason
from tpgraph.comm.thresholds import Algo, useful_blocks
from tpgraph.distributed import ParallelState
from tpgraph.errors import CommError
from tpgraph.tune.launch import smallest_near_best
from tpgraph.tune.timing import K_OPS, MIN_RUNS, capture, eager_op_us, graph_op_us, released

DEFAULT_SIZES = tuple(4096 << i for i in range(15))  # 4 KB .. 64 MB
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
    """Grid sizes worth trying: up to the blocks the message has work for (as the table's resolver caps them)."""
    useful = useful_blocks(algo, nbytes, world_size)
    return sorted({g for g in (*BASE_GRIDS, num_sms, 2 * num_sms) if g <= useful})


def skipped_multicast() -> str:
    reason = multicast_disabled_reason()
    return (f"2shot_multicast not measured: {reason}" if reason
            else "2shot_multicast not measured: this build never creates multicast objects")


def measure(state: ParallelState, ar: CustomAllReduce, sizes: Iterable[int] = DEFAULT_SIZES, runs: int = MIN_RUNS,
            k: int = K_OPS, progress: Callable[[str], None] | None = None) -> list[Measurement]:
    """Every candidate at every size, graph and eager. `progress(label)` is called once per timed candidate."""
    out: list[Measurement] = []
    tick = progress or (lambda _: None)
    for nbytes in sizes:
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=state.device)  # zeros: sums stay finite
        for algo in CUSTOM:
            out += _custom(state, ar, algo, x, runs, k, tick)
        nccl = functools.partial(dist.all_reduce, x, group=state.tp_group)
        graph = capture(nccl, k)
        out.append(Measurement("graph", Algo.NCCL.value, nbytes, graph_op_us(state, graph, k, runs)))
        del graph
        tick(f"nccl {nbytes} B")
        out.append(Measurement("eager", Algo.NCCL.value, nbytes, eager_op_us(state, nccl, k, runs)))
        del x
        torch.cuda.empty_cache()
    return out


def _custom(state: ParallelState, ar: CustomAllReduce, algo: Algo, x: torch.Tensor, runs: int, k: int,
            tick: Callable[[str], None]) -> list[Measurement]:
    nbytes = x.numel() * x.element_size()
    if algo == Algo.PUSH_1SHOT and nbytes > ar.push_slot_bytes:
        note = f"over the push slot ({ar.push_slot_bytes} B)"
        return [Measurement(m, algo.value, nbytes, None, note=note) for m in ("graph", "eager")]
    times: dict[int, float] = {}
    for blocks in grids_for(algo, nbytes, state.world_size, ar.num_sms):
        try:
            with released(ar) as ctx:
                graph = capture(functools.partial(ar.all_reduce, x, algo, blocks=blocks), k, ctx)
                times[blocks] = graph_op_us(state, graph, k, runs)
                del graph
        except CommError:  # more blocks than this kernel keeps resident (refused the same on every rank)
            break
        tick(f"{algo.value} {nbytes} B, {blocks} blocks")
    if not times:
        return [Measurement(m, algo.value, nbytes, None, note="no grid ran") for m in ("graph", "eager")]
    best = smallest_near_best(times)
    graph_m = Measurement("graph", algo.value, nbytes, times[best], best, times)
    if algo != Algo.PUSH_1SHOT and nbytes > ar.staging_bytes:  # eager pull stages its input
        return [graph_m, Measurement("eager", algo.value, nbytes, None, note="over the staging buffer")]
    eager = eager_op_us(state, functools.partial(ar.all_reduce, x, algo, blocks=best), k, runs)
    tick(f"{algo.value} {nbytes} B eager")
    return [graph_m, Measurement("eager", algo.value, nbytes, eager, best)]


def count_steps(sizes: Iterable[int], world_size: int, num_sms: int) -> int:
    """How many progress ticks measure() makes (for the progress bar)."""
    total = 0
    for nbytes in sizes:
        total += 1  # NCCL
        for algo in CUSTOM:
            total += len(grids_for(algo, nbytes, world_size, num_sms)) + 1
    return total
