"""The rows the small-M kernels take (gemv.py's projections and lamport.py's all-reduce epilogue), in a module of
its own so that both read one bound without importing each other."""

from __future__ import annotations

from tpgraph.kernels._settings import env_choice

MAX_M = 16  # the row tile up to 16 rows, and the most rows with TPGRAPH_GEMV_MAX_M=16 or for fp32
# 17-32 rows in 32-row tiles, 16-bit dtypes only (fp32's wider x tiles would outgrow the shared memory of its stages),
# so that a batch-17..32 step streams its weights once per projection instead of taking cuBLAS and the unfused rope,
# SiLU and split-K kernels; the all-reduce epilogue takes them too (lamport's Channel.fits), where the channel's slots
# hold them. The default since it was timed in whole steps on an H200 (TP=1 at a TP=2 rank's Llama-3-8B shape, 512
# tokens; bench/results/2026-12-01_h200_wide_default): 3.312 -> 2.997 ms a step at batch 32, 3.241 -> 2.950 at
# 24, 3.200 -> 2.908 at 17, batch 16 unchanged, with the table's 32-row tiles (keyed at 17, swept at 32 rows). With
# the M<=16 tiles it had lost (+0.019 ms at batch 32, bench/results/2026-12-01_h200_argmax_wide); 32x128 tiles in the
# epilogue projections, which compile without spills, lost too (+0.117 / -0.007 ms at 24 / 32).
# TPGRAPH_GEMV_MAX_M=16 keeps cuBLAS above 16 rows.
WIDE_M = 32


def max_rows(elem: int) -> int:
    """The most rows the kernels take for elements of `elem` bytes: WIDE_M for 16-bit elements, MAX_M for fp32 or
    with TPGRAPH_GEMV_MAX_M=16 (any other value than 16 or 32 is refused)."""
    limit = env_choice("TPGRAPH_GEMV_MAX_M", (MAX_M, WIDE_M), WIDE_M)
    return WIDE_M if limit == WIDE_M and elem <= 2 else MAX_M


def block_m(m: int) -> int:
    """The row tile for m rows: MAX_M (tl.dot's 16) up to MAX_M rows, WIDE_M above."""
    return MAX_M if m <= MAX_M else WIDE_M
