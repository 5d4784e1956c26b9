"""Greedy argmax over a vocabulary row: in one Triton launch on CUDA (kernels/argmax.py), or in two torch stages.

torch's argmax reduces a [B, V] tensor with one reduction per row: on an H200 a [1, 128256] row took 29 µs, about
1% of a Llama-3-8B decode step at TP=2 (bench/bench_decode.py --profile). Cutting the row into C chunks of V / C
gives a reduction with C outputs per row, which spreads over the GPU, then a small one over the chunks' maxima.

The result is argmax's: the first index of the row's maximum, with NaN counted as the maximum. torch.max(dim) gives
each chunk's first maximal index, and the argmax over the chunk maxima the first chunk holding the row's maximum, so
the first maximal index of the row (tests/unit/test_argmax.py checks ties and NaN on CPU; the GPU test on CUDA).

The two stages are still five small kernels between steps; the fused launch does both in one, and what it cannot
compare exactly (fp64 rows, more rows than its counters) comes here.

With the vocabulary split over ranks, greedy decode needs no gathered logits: each rank takes its shard's pair (the
maximum, NaN where there is one, and its global index), the ranks' pairs are gathered (8 bytes a row), and the first
rank holding a NaN, else the first holding the maximum, has torch.argmax's answer for the whole row (shards are in
index order).
"""

from __future__ import annotations

import functools

import torch

from tpgraph.kernels.argmax import (
    MAX_COUNTERS,
    MAX_PAIR_INDEX,
    argmax_rows,
    check_ids_out,
    check_pair_inputs,
    combine_pairs_triton,
    fused_argmax_enabled,
    shard_argmax_pairs_triton,
    takes,
)

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


def _use_triton(x: torch.Tensor, fused: bool | None) -> bool:
    """The kernels' path: asked for explicitly, else on CUDA unless TPGRAPH_FUSED_ARGMAX=0."""
    return (x.is_cuda and fused_argmax_enabled()) if fused is None else fused


def shard_argmax_pairs(x: torch.Tensor, base: int, fused: bool | None = None) -> torch.Tensor:
    """x [B, V] (one rank's vocabulary shard, from global index `base`) -> [B, 2] int32: the fp32 bits of each row's
    maximum (NaN where the row has one) and base + its argmax. One Triton launch on CUDA by default, else torch."""
    check_pair_inputs(x, base)
    if _use_triton(x, fused) and x.shape[1] and x.shape[0] <= MAX_COUNTERS:
        return shard_argmax_pairs_triton(x if x.stride(-1) == 1 else x.contiguous(), base)
    if x.shape[1] == 0:  # a rank holding no real vocabulary: a pair that never wins
        best = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
        return torch.stack([best.view(torch.int32), torch.full_like(best.view(torch.int32), MAX_PAIR_INDEX)], dim=1)
    idx = x.argmax(dim=-1)
    best = x.gather(1, idx.unsqueeze(1)).squeeze(1).float()
    best = best.masked_fill(best.isnan(), float("nan"))  # the NaN bits the kernel stores (the pairs compare equal)
    return torch.stack([best.view(torch.int32), (idx + base).to(torch.int32)], dim=1)


def combine_pairs(pairs: torch.Tensor, out: torch.Tensor | None = None, fused: bool | None = None) -> torch.Tensor:
    """pairs [world, B, 2] int32 (every rank's shard_argmax_pairs, in rank order) -> [B] int64: torch.argmax's
    answer over the concatenated shards (into `out` where given)."""
    if pairs.dim() != 3 or pairs.shape[-1] != 2 or pairs.dtype != torch.int32:
        raise ValueError(f"combine_pairs takes [world, batch, 2] int32 pairs, got {tuple(pairs.shape)} {pairs.dtype}")
    check_ids_out(out, pairs.shape[1], pairs.device, "combine_pairs' out")
    if _use_triton(pairs, fused) and (out is None or out.stride(0) == 1 or len(out) <= 1):
        return combine_pairs_triton(pairs, out=out)
    bests = pairs[..., 0].contiguous().view(torch.float32)  # [world, B]: the first rank with a NaN, else the maximum
    winner = bests.argmax(dim=0, keepdim=True)
    ids = pairs[..., 1].gather(0, winner).squeeze(0).long()
    return ids if out is None else out.copy_(ids)
