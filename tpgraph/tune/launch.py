"""Grid sizes: at each measured size, the smallest grid within NEAR_BEST of the fastest; then bands per algorithm,
written as the table's launch entries."""

from __future__ import annotations

from collections.abc import Mapping

NEAR_BEST = 1.02  # a grid this close to the fastest counts as fast: prefer fewer blocks (less SM contention)


def grid_spec(blocks: int, num_sms: int) -> int | str:
    """A grid size as a table writes it: per-SM multiples by name, so the row carries to GPUs of the same arch
    with other SM counts."""
    if blocks % num_sms == 0:
        k = blocks // num_sms
        return "num_sms" if k == 1 else f"num_sms*{k}"
    return blocks


def smallest_near_best(us_by_blocks: Mapping[int, float]) -> int:
    best = min(us_by_blocks.values())
    return min(b for b, t in us_by_blocks.items() if t <= best * NEAR_BEST)


def launch_bands(best_blocks: Mapping[int, int], num_sms: int) -> list[list]:
    """size -> chosen grid, to [[max_bytes, spec], ...]: each size's grid holds up to that size, equal neighbours
    merge, and the last band also covers larger messages."""
    bands: list[list] = []
    for nbytes in sorted(best_blocks):
        spec = grid_spec(best_blocks[nbytes], num_sms)
        if bands and bands[-1][1] == spec:
            bands[-1][0] = nbytes
        else:
            bands.append([nbytes, spec])
    return bands
