"""Batch -> (graph mode, padded descriptor), through tables built once so a step costs a couple of list lookups."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from tpgraph.errors import ConfigError
from tpgraph.graphs.calibration import describe_counts
from tpgraph.graphs.ladder import check_sizes


class GraphMode(enum.Enum):
    NONE = "none"  # eager
    PIECEWISE = "piecewise"  # graphs between attention calls, keyed on token count only
    FULL = "full"  # one graph per decode batch size
    # debug: keyed like FULL (same buckets, buffers and replay path) but nothing is captured; never dispatched,
    # only recorded in the stats so a breakable run is not mistaken for a graph run
    BREAKABLE = "breakable"


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """What a step runs as. A FULL graph is keyed on (num_tokens, uniform_decode=True), a PIECEWISE one on
    num_tokens alone; num_reqs, num_real_tokens and uniform_decode describe the real batch inside the padding."""

    num_tokens: int  # padded token count the graph was captured for (== unpadded when NONE)
    num_reqs: int  # real sequences
    num_real_tokens: int
    uniform_decode: bool  # one token per sequence

    def __post_init__(self) -> None:
        # A handful of int compares per step; a malformed batch caught here beats a graph replayed on garbage.
        if not 1 <= self.num_reqs <= self.num_real_tokens <= self.num_tokens:
            raise ConfigError(
                f"bad batch: need 1 <= num_reqs ({self.num_reqs}) <= num_real_tokens ({self.num_real_tokens}) "
                f"<= num_tokens ({self.num_tokens})"
            )
        if self.uniform_decode and self.num_reqs != self.num_real_tokens:
            raise ConfigError(
                f"a uniform decode batch has one token per sequence, got {self.num_real_tokens} tokens for "
                f"{self.num_reqs} sequences"
            )

    @property
    def padding(self) -> int:
        return self.num_tokens - self.num_real_tokens


class Dispatcher:
    """Maps a batch to the smallest captured size that holds it: FULL for uniform decode batches up to the largest
    full size, else PIECEWISE up to the largest piecewise size, else NONE (eager, unpadded).

    Either size list may be empty (that mode is off). `eager_counts`: token counts within the piecewise sizes that run
    eagerly all the same, where padding them was measured to cost more than it saves (calibration.py).
    """

    def __init__(self, full_sizes: Iterable[int], piecewise_sizes: Iterable[int],
                 eager_counts: Iterable[int] = ()) -> None:
        self._full_sizes = _sizes(full_sizes, "full_sizes")
        self._piecewise_sizes = _sizes(piecewise_sizes, "piecewise_sizes")
        # table[n] = smallest captured size >= n, for n in 1..max; index 0 is unused so n indexes directly.
        self._full_table = _padding_table(self._full_sizes)
        self._piecewise_table = _padding_table(self._piecewise_sizes)
        self._eager_counts = frozenset(eager_counts)
        outside = sorted(n for n in self._eager_counts if not 1 <= n < len(self._piecewise_table))
        if outside:
            raise ConfigError(f"eager counts {outside[:8]} are outside the piecewise sizes "
                              f"(1..{len(self._piecewise_table) - 1})")
        self._max_full = len(self._full_table) - 1
        self._max_piecewise = len(self._piecewise_table) - 1

    @property
    def full_sizes(self) -> tuple[int, ...]:
        return self._full_sizes

    @property
    def piecewise_sizes(self) -> tuple[int, ...]:
        return self._piecewise_sizes

    @property
    def eager_counts(self) -> tuple[int, ...]:
        return tuple(sorted(self._eager_counts))

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> tuple[GraphMode, BatchDescriptor]:
        # Checked before indexing: a negative index would silently read the table from the end.
        if num_tokens < 1:
            raise ConfigError(f"cannot dispatch a batch of {num_tokens} tokens; a step needs at least one token")
        if uniform_decode and num_tokens <= self._max_full:
            return GraphMode.FULL, BatchDescriptor(self._full_table[num_tokens], num_reqs, num_tokens, True)
        if num_tokens <= self._max_piecewise and num_tokens not in self._eager_counts:
            padded = self._piecewise_table[num_tokens]
            return GraphMode.PIECEWISE, BatchDescriptor(padded, num_reqs, num_tokens, uniform_decode)
        return GraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, num_tokens, uniform_decode)

    def padded_size(self, n: int, mode: GraphMode) -> int:
        """The captured size a batch of n tokens pads to under `mode` (n itself for NONE)."""
        if n < 1:
            raise ConfigError(f"padded_size needs n >= 1, got {n}")
        if mode is GraphMode.NONE:
            return n
        # (BREAKABLE is keyed like FULL: its buckets are the full sizes)
        table = self._full_table if mode in (GraphMode.FULL, GraphMode.BREAKABLE) else self._piecewise_table
        if n >= len(table):
            largest = f"the largest is {len(table) - 1}" if len(table) > 1 else "none were captured"
            raise ConfigError(f"no {mode.value} graph holds {n} tokens: {largest}")
        return table[n]

    def __repr__(self) -> str:
        eager = f", eager_counts={describe_counts(self._eager_counts)}" if self._eager_counts else ""
        return f"Dispatcher(full_sizes={list(self._full_sizes)}, piecewise_sizes={list(self._piecewise_sizes)}{eager})"


def _sizes(values: Iterable[int], what: str) -> tuple[int, ...]:
    values = tuple(values)
    return check_sizes(values, what) if values else ()


def _padding_table(sizes: tuple[int, ...]) -> list[int]:
    table = [0]
    for size in sizes:  # ascending: each size covers the gap above the previous one
        table.extend([size] * (size - len(table) + 1))
    return table
