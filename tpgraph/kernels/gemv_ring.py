"""A one-row bf16 projection whose weights stream through a shared-memory ring of bulk copies (csrc/gemv_ring.cu),
issued before the PDL wait: an experiment against the ~2 µs of ramp and drain that keep o_proj and qkv under 88% of
the HBM bandwidth when timed alone (issue 11; bench/bench_ring_gemv.py times it beside the shipped Triton kernel).
Opt-in on the decode path (`TPGRAPH_RING_GEMV=1`): linear_small_m then takes it for one bf16 row, with DECODE's
launch, until whole steps have been timed with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpgraph._ext import extension_available, load_ext
from tpgraph.kernels._settings import env_choice

VECTOR_ELEMS = 8  # bf16 elements a 16-byte bulk copy moves: k must be a multiple
THREADS = (128, 256, 512)
MAX_VECTORS_PER_THREAD = 8  # csrc/gemv_ring.cu: x's 16-byte vectors a thread keeps in registers
MAX_STAGES = 16


@dataclass(frozen=True)
class RingConfig:
    """A launch: threads a CTA, bytes a chunk brings (whole rows, at least one), the ring's bytes (chunks in flight),
    CTAs a SM, whether it launches as a programmatic dependent, and how a chunk is copied: one bulk copy (TMA) or
    16-byte cp.async pieces from every thread (`per_thread_copies`)."""

    threads: int = 256
    chunk_bytes: int = 16 << 10
    ring_bytes: int = 96 << 10
    per_sm: int = 1
    pdl: bool = True
    per_thread_copies: bool = False
    late_let_in: bool = False  # the next kernel let in once the weights have landed, not at the start

    def __post_init__(self) -> None:
        if self.threads not in THREADS:
            raise ValueError(f"RingConfig: threads must be one of {THREADS}, got {self.threads}")
        if self.chunk_bytes <= 0 or self.ring_bytes < self.chunk_bytes or self.per_sm < 1:
            raise ValueError(f"RingConfig: needs 0 < chunk_bytes <= ring_bytes and per_sm >= 1, got {self}")

    @property
    def label(self) -> str:
        return (f"ring t{self.threads} c{self.chunk_bytes >> 10}k r{self.ring_bytes >> 10}k x{self.per_sm}"
                + ("" if self.pdl else " nopdl") + (" cp.async" if self.per_thread_copies else "")
                + (" late" if self.late_let_in else ""))


# the best launch of the H100 sweeps (bench/results/2026-12-05_h100_s48_ring): 4 CTAs of 128 threads a SM, two 16 KB
# chunks in flight each, per-thread copies
DECODE = RingConfig(threads=128, chunk_bytes=16 << 10, ring_bytes=32 << 10, per_sm=4, per_thread_copies=True)
DECODE_LATE = RingConfig(threads=128, chunk_bytes=16 << 10, ring_bytes=32 << 10, per_sm=4, per_thread_copies=True,
                         late_let_in=True)


def decode_config() -> RingConfig | None:
    """TPGRAPH_RING_GEMV: 0 (default) off, 1 DECODE, 2 DECODE_LATE."""
    return {0: None, 1: DECODE, 2: DECODE_LATE}[env_choice("TPGRAPH_RING_GEMV", (0, 1, 2), 0)]


def ring_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the decode path's projection x @ w.T runs as the ring GEMV: TPGRAPH_RING_GEMV=1 or 2, one contiguous bf16
    row on an sm_90+ GPU, K a multiple of 8 within DECODE's reach, x and w 16-byte aligned."""
    if decode_config() is None or not x.is_cuda or x.dim() != 2 or w.dim() != 2:
        return False
    k = w.shape[1]
    return (x.shape == (1, k) and x.dtype == w.dtype == torch.bfloat16 and x.is_contiguous() and w.is_contiguous()
            and k % VECTOR_ELEMS == 0 and k <= MAX_VECTORS_PER_THREAD * VECTOR_ELEMS * DECODE.threads
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and x.device == w.device
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and extension_available())


@dataclass(frozen=True)
class RingLaunch:
    grid: int
    rows_per_chunk: int
    stages: int


def ring_launch(n: int, k: int, config: RingConfig, sms: int) -> RingLaunch:
    """The grid and ring of a [n, k] bf16 weight: per_sm CTAs a SM (no more than n), chunks of whole rows near
    chunk_bytes, as many stages as fit ring_bytes (at least two, at most MAX_STAGES)."""
    if k <= 0 or k % VECTOR_ELEMS:
        raise ValueError(f"gemv_ring: k must be a positive multiple of {VECTOR_ELEMS} (16-byte bulk copies), got {k}")
    if -(-k // VECTOR_ELEMS) > MAX_VECTORS_PER_THREAD * config.threads:
        raise ValueError(f"gemv_ring: k={k} exceeds what {config.threads} threads keep of x "
                         f"({MAX_VECTORS_PER_THREAD * VECTOR_ELEMS * config.threads}); take more threads")
    row_bytes = k * 2
    rows_per_chunk = max(1, config.chunk_bytes // row_bytes)
    stages = min(MAX_STAGES, max(2, config.ring_bytes // (rows_per_chunk * row_bytes)))
    return RingLaunch(min(n, sms * config.per_sm), rows_per_chunk, stages)


def gemv_ring(x: torch.Tensor, w: torch.Tensor, config: RingConfig = RingConfig(),
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K].T -> [1, N], bf16, on a CUDA device of sm_90 or later."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"gemv_ring takes bf16 x and w, got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or x.shape[0] != 1 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv_ring takes x [1, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("gemv_ring takes contiguous x and w")
    if not x.is_cuda or x.device != w.device or torch.cuda.get_device_capability(x.device)[0] < 9:
        raise ValueError("gemv_ring runs on one CUDA device of sm_90 or later (bulk copies)")
    n, k = w.shape
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"gemv_ring's out must be contiguous [1, {n}] bf16 on {x.device}, got {tuple(out.shape)}")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    launch = ring_launch(n, k, config, sms)
    load_ext().gemv_ring(x.data_ptr(), w.data_ptr(), out.data_ptr(), n, k, launch.grid, config.threads,
                               launch.rows_per_chunk, launch.stages, config.pdl,
                               torch.cuda.current_stream(x.device).cuda_stream, config.per_thread_copies,
                               config.late_let_in)
    return out
