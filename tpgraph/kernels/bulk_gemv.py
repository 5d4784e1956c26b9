"""A small-M projection whose weights stream through shared memory by bulk asynchronous copies (csrc/bulk_gemv.cu).

`bulk_linear(x, w)` = x @ w.T for 1-4 rows of bf16/fp16 on sm_90+. Each block owns a contiguous run of weight rows
and issues its first `stages` chunks of them before its programmatic-dependent wait, so that a projection's weights are
already on their way while the kernel before it (which writes x) finishes. gemv.py's Triton kernel waits first and
pays launch, ramp and drain after the wait (bench/results/2026-12-02_h200_read_ceiling: no wait-first read reached
88% of the bandwidth at o_proj's or qkv's size).

An experiment beside gemv.py: the plain projections (gemv.linear_small_m) take it only with TPGRAPH_BULK_GEMV=1
(`takes`); bench/bench_bulk_gemv.py times it against the shipped kernel and cuBLAS at each projection's shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpgraph._ext import load_ext
from tpgraph.kernels._pdl import use_pdl
from tpgraph.kernels._settings import env_choice

MAX_ROWS = 4
TRIGGERS = ("start", "issued", "exit")  # when the kernel after may become resident: csrc/bulk_gemv.cu's BulkTrigger
WARPS = 8  # a block's warps: rows_per_chunk divides them
VECTOR = 16  # bytes a lane reads at once
MAX_VECTORS = 8  # 16-byte vectors of a row a lane holds x for
CHUNK_BYTES = 16 << 10  # the default chunk: rows whole, at least this many bytes where K lets it


@dataclass(frozen=True)
class BulkConfig:
    """blocks_per_sm: blocks a SM (grid = SMs x this, at most N); rows_per_chunk: whole weight rows a bulk copy moves
    (None: the fewest rows of at least CHUNK_BYTES that a lane's x fits); stages: chunks in flight a block, issued
    before the wait; trigger: when the next kernel is let in (TRIGGERS); evict_first: the copies ask L2 to drop the
    weights first."""

    # the fastest alone at qkv and o_proj on an H100 (bench/results/2026-12-07_h100_s61), within 5% of each
    # projection's fastest: two blocks a SM (one block's chunk loop did not keep up), two stages, evict first
    blocks_per_sm: int = 2
    rows_per_chunk: int | None = None
    stages: int = 2
    trigger: str = "start"
    evict_first: bool = True

    def __post_init__(self) -> None:
        if self.blocks_per_sm < 1:
            raise ValueError(f"BulkConfig.blocks_per_sm must be >= 1, got {self.blocks_per_sm}")
        if self.rows_per_chunk is not None and self.rows_per_chunk not in (1, 2, 4, 8):
            raise ValueError(f"BulkConfig.rows_per_chunk must be 1, 2, 4 or 8, got {self.rows_per_chunk}")
        if not 0 <= self.stages <= 8:
            raise ValueError(f"BulkConfig.stages must be 1-8 (0: FILL), got {self.stages}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"BulkConfig.trigger must be one of {TRIGGERS}, got {self.trigger!r}")

    @property
    def label(self) -> str:
        rows = "auto" if self.rows_per_chunk is None else self.rows_per_chunk
        stages = "fill" if self.stages == FILL else self.stages
        return (f"bulk b{self.blocks_per_sm} r{rows} s{stages} {self.trigger}"
                + (" evict" if self.evict_first else ""))


def rows_per_chunk(k: int, elem: int, config: BulkConfig) -> int:
    """The rows one chunk moves for rows of K elements of `elem` bytes: the config's, else the fewest whose bytes reach
    CHUNK_BYTES while a lane still holds its x in MAX_VECTORS vectors (more rows, fewer warps a row)."""
    if config.rows_per_chunk is not None:
        return config.rows_per_chunk
    vectors = k * elem // VECTOR
    rows = 1
    while rows < WARPS and rows * k * elem < CHUNK_BYTES and vectors <= MAX_VECTORS * 32 * (WARPS // (2 * rows)):
        rows *= 2
    return rows


def check_inputs(x: torch.Tensor, w: torch.Tensor) -> None:
    """What the kernel takes, refused with the reason before any launch."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"bulk_linear needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"bulk_linear takes bfloat16 or float16 x and w of one dtype, got {x.dtype} and {w.dtype}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"bulk_linear takes 1-{MAX_ROWS} rows of x, got {x.shape[0]}")
    if not (x.is_cuda and w.is_cuda and x.device == w.device):
        raise ValueError(f"bulk_linear runs on one CUDA device, got x on {x.device} and w on {w.device}")
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        raise ValueError("bulk_linear needs sm_90 or later (bulk asynchronous copies)")
    elems = VECTOR // x.element_size()
    if x.shape[1] % elems:
        raise ValueError(f"bulk_linear needs K a multiple of {elems}, got {x.shape[1]}")
    if not (x.is_contiguous() and w.is_contiguous()) or x.data_ptr() % VECTOR or w.data_ptr() % VECTOR:
        raise ValueError(f"bulk_linear needs contiguous, {VECTOR}-byte aligned x and w")


def step_config() -> BulkConfig | None:
    """The config gemv.linear_small_m hands its projections to bulk_linear with, or None (the shipped Triton kernel):
    TPGRAPH_BULK_GEMV=1 the default config, 2 with each block's whole slice issued before the wait where it fits
    FILL_BYTES (`filled`); 0 or unset: none (off by default until it wins whole steps)."""
    choice = env_choice("TPGRAPH_BULK_GEMV", (0, 1, 2), 0)
    return None if not choice else BulkConfig(stages=FILL if choice == 2 else BulkConfig().stages)


FILL = 0  # BulkConfig.stages for "as many as the block's slice has chunks, within FILL_BYTES"
FILL_BYTES = 96 << 10  # two blocks a SM keep their rings in shared memory


def stages_for(config: BulkConfig, n: int, k: int, elem: int, blocks: int) -> int:
    """The config's stages; for FILL, the chunks of the largest block's slice, at most 8 and FILL_BYTES (at least 1)."""
    if config.stages != FILL:
        return config.stages
    rows = rows_per_chunk(k, elem, config)
    largest = -(-n // blocks)  # rows of the largest block's slice
    chunks = -(-largest // rows)
    return max(1, min(8, chunks, FILL_BYTES // (rows * k * elem)))


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gemv.linear_small_m may hand x @ w.T to bulk_linear: inputs it takes (1-4 rows, bf16/fp16, sm_90+, K
    whole vectors that a lane's x fits, aligned)."""
    if not x.is_cuda:
        return False
    try:
        check_inputs(x, w)
    except ValueError:
        return False
    return x.shape[1] * x.element_size() // VECTOR <= MAX_VECTORS * 32 * WARPS


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def bulk_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: BulkConfig = BulkConfig()) -> torch.Tensor:
    """x @ w.T through csrc/bulk_gemv.cu (see the module docstring), into `out` [M, N] if given."""
    check_inputs(x, w)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"bulk_linear's out must be a contiguous [{m}, {n}] {x.dtype} tensor on {x.device}")
    ext = load_ext()
    blocks = min(n, _sm_count(x.device.index) * config.blocks_per_sm)
    ext.bulk_gemv(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k, ext.dtype_codes()[str(x.dtype)[6:]], blocks,
                  rows_per_chunk(k, x.element_size(), config), stages_for(config, n, k, x.element_size(), blocks),
                  TRIGGERS.index(config.trigger),
                  config.evict_first, use_pdl(x), torch.cuda.current_stream(x.device).cuda_stream)
    return out
