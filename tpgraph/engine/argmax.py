"""Greedy argmax over a vocabulary row: in one Triton launch on CUDA (kernels/argmax.py), or in two torch stages.

torch's argmax reduces a [B, V] tensor with one reduction per row: on an H200 a [1, 128256] row took 29 µs, about
1% of a Llama-3-8B decode step at TP=2 (bench/bench_decode.py --profile). Cutting the row into C chunks of V / C
gives a reduction with C outputs per row, which spreads over the GPU, then a small one over the chunks' maxima.

The result is argmax's: the first index of the row's maximum, with NaN counted as the maximum. torch.max(dim) gives
each chunk's first maximal index, and the argmax over the chunk maxima the first chunk holding the row's maximum, so
the first maximal index of the row (tests/unit/test_argmax.py checks ties and NaN on CPU; the GPU test on CUDA).

The two stages are still five small kernels between steps; the fused launch does both in one, and what it cannot
compare exactly (fp64 rows, more rows than its counters) comes here.

With the vocabulary split over ranks, greedy decode needs no gathered logits: each rank takes its shard's maximum (NaN
where there is one) and its global index, and the first rank holding a NaN, else the first holding the maximum, has
torch.argmax's answer for the whole row (shards are in index order). Those are exchanged as slots: [world, B, 4] fp32,
zeros but in the rank's own slot, which holds the maximum's sortable key (ordered as the floats, NaN above +inf, -0.0
as +0.0) and the index, each as two 16-bit halves written as fp32 integers. Summed over the ranks by one all-reduce,
every slot is then filled exactly (one rank's integer below 2^16 plus zeros, on any path: no rounding, no denormal
flushed, never the custom all-reduce's sentinel), and the all-reduce is the decode step's cheapest collective: the
custom one's latency, not NCCL's all-gather.
"""

from __future__ import annotations

import functools

import torch

from tpgraph.kernels.argmax import (
    MAX_COUNTERS,
    argmax_rows,
    check_ids_out,
    check_slot_inputs,
    combine_slots_triton,
    fused_argmax_enabled,
    shard_argmax_slots_triton,
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


def slot_words(best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """best [B] fp32 (a row's maximum, NaN where it has one), index [B] -> [B, 4] fp32: the key's and the index's
    16-bit halves (kernels/argmax.py's _slot_words)."""
    best = best.masked_fill(best == 0, 0.0)  # -0.0 ties +0.0
    bits = best.view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
    key = key.masked_fill(best.isnan(), 0xFFFFFFFF)
    index = index.long()
    return torch.stack([key >> 16, key & 0xFFFF, index >> 16, index & 0xFFFF], dim=1).float()


def shard_argmax_slots(x: torch.Tensor, base: int, rank: int, world: int, fused: bool | None = None) -> torch.Tensor:
    """x [B, V] (rank `rank`'s vocabulary shard, from global index `base`) -> [world, B, 4] fp32 slots: zeros but
    slot `rank`, each row's maximum's key and base + its argmax (see the module docstring). Sum them over the ranks
    and combine_slots gives the ids. One Triton launch on CUDA by default, else torch."""
    check_slot_inputs(x, base, rank, world)
    if _use_triton(x, fused) and x.shape[1] and x.shape[0] <= MAX_COUNTERS:
        return shard_argmax_slots_triton(x if x.stride(-1) == 1 else x.contiguous(), base, rank, world)
    slots = torch.zeros(world, x.shape[0], 4, dtype=torch.float32, device=x.device)
    if x.shape[1]:  # (a rank holding no real vocabulary leaves key 0, below every float's: it never wins)
        idx = x.argmax(dim=-1)
        slots[rank] = slot_words(x.gather(1, idx.unsqueeze(1)).squeeze(1).float(), idx + base)
    return slots


def combine_slots(slots: torch.Tensor, out: torch.Tensor | None = None, fused: bool | None = None) -> torch.Tensor:
    """slots [world, B, 4] fp32 (every rank's shard_argmax_slots, summed over the ranks) -> [B] int64: torch.argmax's
    answer over the concatenated shards (into `out` where given)."""
    if slots.dim() != 3 or slots.shape[-1] != 4 or slots.dtype != torch.float32:
        raise ValueError(f"combine_slots takes [world, batch, 4] fp32 slots, got {tuple(slots.shape)} {slots.dtype}")
    check_ids_out(out, slots.shape[1], slots.device, "combine_slots' out")
    if _use_triton(slots, fused) and (out is None or out.stride(0) == 1 or len(out) <= 1):
        return combine_slots_triton(slots, out=out)
    halves = slots.long()
    keys = halves[..., 0] * 65536 + halves[..., 1]  # [world, B]: argmax over the ranks is the first largest key
    winner = keys.argmax(dim=0, keepdim=True)
    ids = (halves[..., 2] * 65536 + halves[..., 3]).gather(0, winner).squeeze(0)
    return ids if out is None else out.copy_(ids)
