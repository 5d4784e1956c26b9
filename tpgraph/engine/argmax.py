"""Greedy argmax over a vocabulary row: in one Triton launch on CUDA (kernels/argmax.py), or in two torch stages.

torch's argmax reduces a [B, V] tensor with one reduction per row: on an H200 a [1, 128256] row took 29 µs, about
1% of a Llama-3-8B decode step at TP=2 (bench/bench_decode.py --profile). Cutting the row into C chunks of V / C
gives a reduction with C outputs per row, which spreads over the GPU, then a small one over the chunks' maxima.

The result is argmax's: the first index of the row's maximum, with NaN counted as the maximum. torch.max(dim) gives
each chunk's first maximal index, and the argmax over the chunk maxima the first chunk holding the row's maximum, so
the first maximal index of the row (tests/unit/test_argmax.py checks ties and NaN on CPU; the GPU test on CUDA).
The two stages are still five small kernels between steps; the fused launch does both in one, and what it cannot
compare exactly (fp64 rows, more rows than its counters) comes here.
"""

from __future__ import annotations

import functools

import torch

from tpgraph.kernels.argmax import argmax_rows, check_ids_out, fused_argmax_enabled, takes

MIN_CHUNK, MAX_CHUNKS = 64, 512  # chunks of at least 64 entries, at most 512 of them (Llama-3: 501 x 256)


@functools.cache
def chunks_for(vocab: int) -> int:
    """The most chunks (at most MAX_CHUNKS) that divide `vocab` into equal pieces of at least MIN_CHUNK; 1 where
    no such split exists (a prime vocabulary): the plain argmax."""
    for c in range(min(MAX_CHUNKS, vocab // MIN_CHUNK), 1, -1):
        if vocab % c == 0:
            return c
    return 1


def row_argmax(x: torch.Tensor, two_stage: bool | None = None, fused: bool | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, V] -> [B] int64: x.argmax(dim=-1). On CUDA by default in one Triton launch (kernels/argmax.py), and in
    the two torch stages (see the module docstring) with TPGRAPH_FUSED_ARGMAX=0; `fused` and `two_stage` ask for
    one path explicitly (`two_stage` also on CPU, where torch.argmax is the default). `out` ([B] int64 on x's
    device): where the ids go (the fused kernel writes them there itself; the other paths copy them in)."""
    if x.dim() != 2:
        raise ValueError(f"row_argmax takes [batch, vocab] logits, got {tuple(x.shape)}")
    check_ids_out(out, x.shape[0], x.device, "row_argmax's out")
    use_fused = (x.is_cuda and two_stage is None and fused_argmax_enabled()) if fused is None else fused
    if use_fused and takes(x):  # (fp64 rows, or more rows than the kernel's counters, take torch's path)
        return argmax_rows(x if x.stride(-1) == 1 else x.contiguous(), out=out)
    ids = _two_stage_or_plain(x, two_stage)
    return ids if out is None else out.copy_(ids)


def _two_stage_or_plain(x: torch.Tensor, two_stage: bool | None) -> torch.Tensor:
    batch, vocab = x.shape
    chunks = chunks_for(vocab)
    if not (x.is_cuda if two_stage is None else two_stage) or chunks == 1 or batch == 0:
        return x.argmax(dim=-1)
    width = vocab // chunks
    maxima, within = x.reshape(batch, chunks, width).max(dim=-1)
    chunk = maxima.argmax(dim=-1, keepdim=True)
    return (chunk * width + within.gather(1, chunk)).squeeze(1)
