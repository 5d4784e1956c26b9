"""The rows the small-M kernels take (gemv.py's projections and lamport.py's all-reduce epilogue), in a module of
its own so that both read one bound without importing each other."""

from __future__ import annotations

import os

from tpgraph.errors import ConfigError

MAX_M = 16  # the rows the kernels take by default, and the row tile up to them
# TPGRAPH_GEMV_MAX_M=32 (opt-in): 17-32 rows in 32-row tiles, 16-bit dtypes only (fp32's wider x tiles would outgrow
# the shared memory of its stages), so that a batch-17..32 step streams its weights once per projection instead of
# taking cuBLAS and the unfused rope, SiLU and split-K kernels; the all-reduce epilogue takes them too (lamport's
# Channel.fits), where the channel's slots hold them. Timed on an H200 with the M<=16 tiles it lost (+0.019 ms a step
# at batch 32; bench/results/2026-12-01_h200_argmax_wide): down alone took 22.0 us against cuBLAS's 20.0. Swept at
# 32 rows, the table's 32-row tiles (keyed at 17) beat cuBLAS at qkv (10.6 / 11.2 us) and down (18.3 / 19.1), tie
# at o_proj and trail by 0.9 us at gate_up (which drops the SiLU kernel); whole steps with them are not yet timed.
WIDE_M = 32


def max_rows(elem: int) -> int:
    """The most rows the kernels take for elements of `elem` bytes: MAX_M, or WIDE_M for 16-bit elements with
    TPGRAPH_GEMV_MAX_M=32 (any other value than 16 or 32 is refused)."""
    value = os.environ.get("TPGRAPH_GEMV_MAX_M", "").strip()
    if value not in ("", str(MAX_M), str(WIDE_M)):
        raise ConfigError(f"TPGRAPH_GEMV_MAX_M must be {MAX_M} or {WIDE_M}, got {value!r}")
    return WIDE_M if value == str(WIDE_M) and elem <= 2 else MAX_M


def block_m(m: int) -> int:
    """The row tile for m rows: MAX_M (tl.dot's 16) up to MAX_M rows, WIDE_M above."""
    return MAX_M if m <= MAX_M else WIDE_M
