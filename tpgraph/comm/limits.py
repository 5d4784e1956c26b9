"""The kernels' fixed sizes and codes, read from the extension (csrc/ar_context.cu), so the Python policy never
works from a copy that could drift from what the kernels were built with."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpgraph._ext import extension_available, load_ext


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


# What the kernels are built with, for installs without the extension (no nvcc), where the custom all-reduce never
# runs but tables are still read and written (tests, the tuner's writer). test_kernel_limits checks it against the
# extension, so it cannot drift unnoticed.
BUILT_WITH = KernelLimits(vector_bytes=16, threads_per_block=512, push_chunk_vectors=32, max_blocks=1024, max_ranks=8,
                          norm_max_row_chunks=64)


@functools.cache
def kernel_limits() -> KernelLimits:
    if not extension_available():
        return BUILT_WITH
    return KernelLimits(**load_ext().limits())


@functools.cache
def algo_codes() -> dict[str, int]:
    """Algorithm name (Algo's value) -> the code ar_all_reduce takes."""
    return dict(load_ext().algo_codes())


@functools.cache
def dtype_codes() -> dict[torch.dtype, int]:
    return {getattr(torch, name): code for name, code in load_ext().dtype_codes().items()}
