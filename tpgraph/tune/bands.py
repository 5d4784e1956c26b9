"""From measured curves to a table row: monotone bands, chosen to lose the least time.

A row says: 1shot_push up to push_max, then 1shot_pull up to pull1_max, then 2shot_pull up to pull2_max, then NCCL.
The measured winner need not follow that order (curves cross back, noise flips close calls), so the bands are the
monotone assignment with the least total excess time, where excess is counted only beyond `tolerance` of the
fastest at that size: an algorithm within it counts as fast. Every band that is used must cover at least
`min_points` consecutive measured sizes (hysteresis: one noisy point cannot open a band). Among equally good
assignments the one with the fewest bands wins, then the one with the least time in all (so that of two algorithms
within the tolerance of each other the faster gets the band), then the one that hands sizes to earlier bands.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ORDER = ("1shot_push", "1shot_pull", "2shot_pull", "nccl")  # the table's band order
BOUND_KEYS = ("push_max", "pull1_max", "pull2_max")
DEFAULT_TOLERANCE = 0.03
DEFAULT_MIN_POINTS = 2


@dataclass(frozen=True)
class Curves:
    """Per-op time (µs) of each algorithm at each measured size (bytes, ascending). An algorithm not measured (or
    refused at a size) has no entry there: it cannot get that size. A figure that is not a time (NaN, inf, zero or
    below) counts as not measured. Every size needs at least one time."""

    sizes: tuple[int, ...]
    times: Mapping[str, Sequence[float | None]]

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)) or not self.sizes:
            raise ValueError("sizes must be distinct and ascending")
        unknown = set(self.times) - set(ORDER)
        if unknown:
            raise ValueError(f"unknown algorithms {sorted(unknown)}; known: {ORDER}")
        if "nccl" not in self.times:
            raise ValueError("NCCL must be measured: it takes every size above the last band")
        for algo, ts in self.times.items():
            if len(ts) != len(self.sizes):
                raise ValueError(f"{algo}: {len(ts)} times for {len(self.sizes)} sizes")
        for i, nbytes in enumerate(self.sizes):  # (else every assignment costs inf there and the fewest bands win)
            if all(self.time(a, i) is None for a in self.times):
                raise ValueError(f"no algorithm has a time at {nbytes} bytes (not measured, NaN, inf or not above 0): "
                                 "no band can be chosen there")

    def time(self, algo: str, i: int) -> float | None:
        ts = self.times.get(algo)
        t = None if ts is None else ts[i]
        # NaN, inf, zero or below: not measured (a zero best divided the others by zero; inf over inf was NaN)
        return float(t) if t is not None and math.isfinite(t) and t > 0 else None

    def best(self, i: int) -> float:
        return min(t for a in ORDER if (t := self.time(a, i)) is not None)


@dataclass(frozen=True)
class BandChoice:
    bounds: dict[str, int]  # push_max, pull1_max, pull2_max (inclusive bytes)
    owner: tuple[str, ...]  # the algorithm each measured size goes to
    excess: float  # summed relative excess beyond the tolerance, over the sizes


def derive_bands(curves: Curves, tolerance: float = DEFAULT_TOLERANCE,
                 min_points: int = DEFAULT_MIN_POINTS) -> BandChoice:
    """The monotone bands with the least excess time (see the module docstring)."""
    n = len(curves.sizes)
    cost = [[_excess(curves, a, i, tolerance) for i in range(n)] for a in ORDER]
    slowness = [[_excess(curves, a, i, 0.0) for i in range(n)] for a in ORDER]  # tie-break: excess at no tolerance
    best: tuple | None = None
    # cuts c0 <= c1 <= c2: sizes [0, c0) push, [c0, c1) pull1, [c1, c2) pull2, [c2, n) NCCL
    for cuts in itertools.combinations_with_replacement(range(n + 1), len(ORDER) - 1):
        edges = (0, *cuts, n)
        spans = [(edges[k], edges[k + 1]) for k in range(len(ORDER))]
        if any(0 < hi - lo < min(min_points, n) for lo, hi in spans):
            continue
        total = sum(cost[k][i] for k, (lo, hi) in enumerate(spans) for i in range(lo, hi))
        used = sum(1 for lo, hi in spans if hi > lo)
        slow = sum(slowness[k][i] for k, (lo, hi) in enumerate(spans) for i in range(lo, hi))
        # least excess, fewest bands, least time, earlier bands larger
        key = (round(total, 9), used, round(slow, 9), tuple(-c for c in cuts))
        if best is None or key < best[0]:
            best = (key, spans, total)
    assert best is not None  # all sizes to NCCL is always allowed
    _, spans, total = best
    owner = tuple(ORDER[k] for k, (lo, hi) in enumerate(spans) for _ in range(lo, hi))
    bounds, last = {}, 0
    for k, key in enumerate(BOUND_KEYS):
        lo, hi = spans[k]
        if hi > lo:
            last = curves.sizes[hi - 1]
        bounds[key] = last  # an empty band keeps the previous bound: it holds no size
    return BandChoice(bounds, owner, total)


def _excess(curves: Curves, algo: str, i: int, tolerance: float) -> float:
    t = curves.time(algo, i)
    if t is None:
        return float("inf")
    return max(0.0, t / curves.best(i) - 1.0 - tolerance)
