"""Capture-size ladders: which batch sizes get a CUDA graph, and the sizes that cover a given max batch.

vLLM pads 9 to 16; SGLang's extra 12 rung pads it to 12. REFERENCE.md ("Capture ladders") holds the recipes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from numbers import Integral

from tpgraph.checks import positive_int
from tpgraph.errors import ConfigError

LADDERS = ("vllm", "sglang")
# The widest gap between rungs of either named ladder; generating up to max_batch + this always yields a rung
# >= max_batch.
_MAX_RUNG_GAP = 32


def vllm_ladder(max_size: int = 512) -> tuple[int, ...]:
    """vLLM's ladder: 1, 2, 4, then every 8 below 256, then every 16 up to max_size (51 sizes at 512)."""
    _check_max_size(max_size)
    rungs = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return tuple(s for s in rungs if s <= max_size)


def sglang_ladder(max_size: int = 256) -> tuple[int, ...]:
    """SGLang's ladder: 1, 2, 4, 8, 12, every 8 to 256, every 16 below 512, every 32 up to max_size (36 at 256)."""
    _check_max_size(max_size)
    rungs = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_size + 1, 32)]
    return tuple(s for s in rungs if s <= max_size)


_GENERATORS = {"vllm": vllm_ladder, "sglang": sglang_ladder}


def check_sizes(values: Sequence[int], what: str) -> tuple[int, ...]:
    """`values` as an ascending tuple; ConfigError naming `what` if empty, non-integer, non-positive or repeated."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a sequence of positive integers, got {values!r}")
    if len(values) == 0:
        raise ConfigError(f"{what} is empty; give at least one positive size")
    sizes = []
    for v in values:
        # bool is an int subclass, but True as a size is always a mistake; numpy integers are fine.
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise ConfigError(f"{what} entry {v!r} is not an integer (got {list(values)!r})")
        if v < 1:
            raise ConfigError(f"{what} entry {v} is not positive (got {list(values)!r})")
        sizes.append(int(v))
    dups = sorted({v for v in sizes if sizes.count(v) > 1})
    if dups:
        raise ConfigError(f"{what} repeats {dups} (got {list(values)!r}); list each size once")
    return tuple(sorted(sizes))


def parse_ladder(spec: str | Sequence[int]) -> str | tuple[int, ...]:
    """A named ladder ("vllm", "sglang") as its name, or an explicit list ("1,2,4,8" or a sequence) as a tuple."""
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name in LADDERS:
            return name
        if not name:
            raise ConfigError(f"cuda graph ladder is empty; choose {' or '.join(LADDERS)} or a list such as '1,2,4,8'")
        sizes = []
        for p in (p.strip() for p in spec.split(",")):
            try:
                sizes.append(int(p))
            except ValueError:
                raise ConfigError(
                    f"cuda graph ladder {spec!r}: entry {p!r} is not an integer; choose "
                    f"{' or '.join(LADDERS)} or a comma-separated list such as '1,2,4,8'"
                ) from None
        return check_sizes(sizes, "cuda graph ladder")
    return check_sizes(spec, "cuda graph ladder")


def capture_sizes(spec: str | Sequence[int], max_batch: int) -> tuple[int, ...]:
    """Ascending bucket sizes for batches 1..max_batch: rungs <= max_batch plus the first rung >= it. Explicit sizes
    that top out below max_batch are all kept: larger batches run eagerly, as vLLM runs batches past its largest
    capture size (eager_above says from where)."""
    positive_int("max_batch", max_batch)
    ladder = parse_ladder(spec)
    rungs = _GENERATORS[ladder](max_batch + _MAX_RUNG_GAP) if isinstance(ladder, str) else ladder
    return rungs[: bisect_left(rungs, max_batch) + 1]


def eager_above(sizes: Sequence[int], max_batch: int) -> int | None:
    """The largest captured size where decode batches above it (up to max_batch) run eagerly, else None."""
    return sizes[-1] if sizes and sizes[-1] < max_batch else None


def _check_max_size(max_size: int) -> None:
    positive_int("ladder max_size", max_size)


def within_budget(sizes: Sequence[int], budget: int) -> tuple[int, ...]:
    """The ascending sizes a forward of at most `budget` rows can use: those below it and the first that holds it."""
    above = [s for s in sizes if s >= budget]
    return tuple(s for s in sizes if s < budget) + tuple(above[:1])
