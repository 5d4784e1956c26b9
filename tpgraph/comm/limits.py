"""The kernels' fixed sizes and codes, read from the extension (csrc/ar_context.cu), so the Python policy never
works from a copy that could drift from what the kernels were built with."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpgraph._ext import load_ext


@dataclass(frozen=True)
class KernelLimits:
    vector_bytes: int  # every custom kernel moves vectors of this size; messages are whole vectors
    threads_per_block: int
    push_chunk_vectors: int  # 1shot_push deals one warp's vectors (a chunk) at a time
    max_blocks: int
    max_ranks: int
    norm_max_row_chunks: int  # the fused push + RMSNorm kernel's rows hold at most this many chunks

    @property
    def chunk_bytes(self) -> int:
        return self.push_chunk_vectors * self.vector_bytes


@functools.cache
def kernel_limits() -> KernelLimits:
    return KernelLimits(**load_ext().limits())


@functools.cache
def algo_codes() -> dict[str, int]:
    """Algorithm name (Algo's value) -> the code ar_all_reduce takes."""
    return dict(load_ext().algo_codes())


@functools.cache
def dtype_codes() -> dict[torch.dtype, int]:
    return {getattr(torch, name): code for name, code in load_ext().dtype_codes().items()}
