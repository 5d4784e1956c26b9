"""Where a piecewise prefill graph pays: an eager forward of n tokens against the graph of the size n pads to, from
timings taken once, after capture.

A piecewise graph saves a forward's host time (its launches) and costs the GEMM rows it pads. On an H200 with
Llama-3-8B at TP=1 an eager forward below some 800 tokens waits on the host, so any padding pays; past that the GPU's
work hides the launches, and 900 tokens padded to 960 measured 4% slower than eager (session 43). Where the crossover
lies depends on the GPU, the model, TP and the host, so it is measured on the machine that serves, and every rank
takes the slowest rank's figures, so that all of them dispatch alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tpgraph.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SizeTiming:
    """One captured size's forwards, in seconds from launch to completion (host and device)."""

    size: int
    eager_s: float  # an eager forward of `size` tokens
    graph_s: float  # the size's graph replayed with `size` real tokens


def time_forward(run: Callable[[], object], sync: Callable[[], None], reps: int = 3) -> float:
    """Median wall time of `run` over `reps` runs after one warm-up, each from a synced start to a synced end: an
    eager forward's host time counts, which is what a graph saves."""
    if reps < 1:
        raise ConfigError(f"reps must be >= 1, got {reps}")
    run()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(per_rank: Sequence[Sequence[SizeTiming]]) -> list[SizeTiming]:
    """Every rank's timings as one list: each size's slowest eager and slowest graph forward."""
    sizes = [t.size for t in per_rank[0]]
    if any([t.size for t in rank] != sizes for rank in per_rank):
        raise ConfigError(f"ranks timed different prefill sizes: {[[t.size for t in r] for r in per_rank]}")
    return [SizeTiming(size, max(r[i].eager_s for r in per_rank), max(r[i].graph_s for r in per_rank))
            for i, size in enumerate(sizes)]


def eager_counts(timings: Sequence[SizeTiming]) -> tuple[int, ...]:
    """The token counts that run faster eagerly than padded to the first captured size that holds them.

    An eager forward of n tokens, between captured sizes a < n <= b, is estimated on the line between the eager
    forwards timed at a and b (below the smallest size, as the smallest); its graph costs b's replay, whatever the
    padding."""
    order = sorted(timings, key=lambda t: t.size)
    counts: list[int] = []
    below: SizeTiming | None = None
    for t in order:
        low = 0 if below is None else below.size
        for n in range(low + 1, t.size + 1):
            eager = t.eager_s if below is None else \
                below.eager_s + (t.eager_s - below.eager_s) * (n - below.size) / (t.size - below.size)
            if eager < t.graph_s:
                counts.append(n)
        below = t
    return tuple(counts)


def describe_counts(counts: Iterable[int]) -> str:
    """Token counts as ranges: "833-895, 897-959"; "none" when empty."""
    spans: list[list[int]] = []
    for n in sorted(counts):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "none"
