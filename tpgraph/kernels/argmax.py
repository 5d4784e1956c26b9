"""Greedy argmax over vocabulary rows in one Triton launch (on CUDA by default; TPGRAPH_FUSED_ARGMAX=0 turns it off).

engine/argmax.py's two-stage argmax is five small torch kernels between two decode steps (a chunked max, an argmax
over the chunk maxima, a gather, a multiply and an add), each a few µs on the GPU's critical path. Here one grid of
(rows, chunks) programs does both stages: each program finds its chunk's first maximum and stores it, and the
program that arrives last for its row (kernels/_counters.py) picks the first chunk holding the row's maximum.

The answer is torch.argmax's: the first index of the row's maximum, NaN counted as the maximum (the first NaN).
"""

from __future__ import annotations

import torch

from tpgraph.kernels._counters import MAX_COUNTERS, split_counters
from tpgraph.kernels._settings import env_flag

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._counters import arrived_last, reset_counter
except ImportError:  # CPU-only installs without Triton use engine/argmax.py's torch path
    triton = None

CHUNK = 1024  # entries a program scans (a bf16 row of 128256 entries: 126 programs)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # compared in fp32: exact for these, not for fp64
MAX_SLOT_INDEX = (1 << 31) - 1  # a shard's slot carries its global index as int32 (in 16-bit halves)


def takes(x: torch.Tensor) -> bool:
    """Whether argmax_rows gives torch.argmax's answer for x: a float type it compares exactly, and a batch the shared
    counters hold."""
    return x.dtype in DTYPES and x.dim() == 2 and x.shape[0] <= MAX_COUNTERS


def fused_argmax_enabled() -> bool:
    """Whether engine/argmax.row_argmax takes this kernel on CUDA: yes unless TPGRAPH_FUSED_ARGMAX=0. On an H200 it
    took 0.014-0.020 ms off a whole decode step at batches 1, 8 and 32 (bench/results/2026-12-01_h200_argmax_wide)."""
    return env_flag("TPGRAPH_FUSED_ARGMAX", default=True)


def check_ids_out(out: torch.Tensor | None, rows: int, device: torch.device, name: str,
                  unit_stride: bool = False) -> None:
    """Refuse, by `name`, a tensor that cannot take `rows` ids: [rows] int64 on `device`, with a unit stride where
    asked (None: nothing to check)."""
    if out is not None and (out.shape != (rows,) or out.dtype != torch.int64 or out.device != device
                            or (unit_stride and rows > 1 and out.stride(0) != 1)):
        stride = " with a unit stride" if unit_stride else ""
        raise ValueError(f"{name} must be [{rows}] int64{stride} on {device}, got {tuple(out.shape)} {out.dtype} on "
                         f"{out.device}")


if triton is not None:

    @triton.jit
    def _chunk_first_max(x_ptr, row, c, V, stride_x, CHUNK: tl.constexpr):
        """(has NaN, the chunk's maximum ignoring NaN, the index of its first NaN or else of its first maximum)."""
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
        nan = (x != x) & ok
        has_nan = tl.max(nan.to(tl.int32), axis=0)
        clean = tl.where(nan, float("-inf"), x)
        best = tl.max(clean, axis=0)
        first_nan = tl.min(tl.where(nan, offs, V), axis=0)
        first_best = tl.min(tl.where(ok & (clean == best), offs, V), axis=0)
        return has_nan, best, tl.where(has_nan > 0, first_nan, first_best)

    @triton.jit
    def _first_of(bests, idxs, nans, ok, V):
        """Across partials in index order (chunks of a row, or ranks' shards): the first partial's index among those
        holding a NaN, else among those holding the maximum; and that maximum (NaN where there was one)."""
        top = tl.max(bests, axis=0)
        first_nan = tl.min(tl.where(ok & (nans > 0), idxs, V), axis=0)
        first_top = tl.min(tl.where(ok & (bests == top), idxs, V), axis=0)
        any_nan = tl.max(tl.where(ok, nans, 0), axis=0) > 0
        return tl.where(any_nan, first_nan, first_top), tl.where(any_nan, float("nan"), top)

    @triton.jit
    def _slot_words(top, winner):
        """(the sortable key's high and low 16 bits, the index's high and low 16 bits) as fp32 integers: the key of
        fp32 `top` orders as the floats do (NaN above +inf, -0.0 as +0.0), and 0 is below every float's."""
        top = tl.where(top == 0.0, 0.0, top)  # -0.0 ties +0.0, as torch.argmax compares them
        bits = top.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
        key = tl.where(top != top, 0xFFFFFFFF, key)
        index = winner.to(tl.int64)
        return ((key >> 16).to(tl.float32), (key & 0xFFFF).to(tl.float32), (index >> 16).to(tl.float32),
                (index & 0xFFFF).to(tl.float32))

    @triton.jit
    def _argmax_kernel(x_ptr, ids_ptr, slot_ptr, part_best_ptr, part_idx_ptr, part_nan_ptr, counter_ptr, V, stride_x,
                       chunks, base, rank, world, rows, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr,
                       SLOTS: tl.constexpr):
        """Grid (rows, chunks). Partials at [row, chunk] of the three part_ buffers; the row's last program reduces
        them: the first chunk holding a NaN, else the first chunk holding the maximum (its index is the chunk's
        first), so the row's first NaN or first maximum. SLOTS: instead of the int64 id, the row's slot words
        [world, rows, 4] fp32: in slot `rank` that maximum's key and base + its index (_slot_words), zeros in the
        others (a vocabulary shard's answer, for an all-reduce and then combine_slots)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        has_nan, best, idx = _chunk_first_max(x_ptr, row, c, V, stride_x, CHUNK)
        at = row * chunks + c
        tl.store(part_best_ptr + at, best)
        tl.store(part_idx_ptr + at, idx)
        tl.store(part_nan_ptr + at, has_nan)
        if arrived_last(counter_ptr + row, chunks):
            cs = tl.arange(0, CHUNKS_P2)
            ok = cs < chunks
            bests = tl.load(part_best_ptr + row * chunks + cs, mask=ok, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + row * chunks + cs, mask=ok, other=V, cache_modifier=".cg")
            nans = tl.load(part_nan_ptr + row * chunks + cs, mask=ok, other=0, cache_modifier=".cg")
            winner, top = _first_of(bests, idxs, nans, ok, V)
            if SLOTS:
                key_hi, key_lo, idx_hi, idx_lo = _slot_words(top, winner + base)
                w = tl.arange(0, 4)
                words = tl.where(w == 0, key_hi, tl.where(w == 1, key_lo, tl.where(w == 2, idx_hi, idx_lo)))
                for r in range(world):
                    tl.store(slot_ptr + (r * rows + row) * 4 + w, tl.where(r == rank, words, 0.0))
            else:
                tl.store(ids_ptr + row, winner.to(tl.int64))
            reset_counter(counter_ptr + row)

    @triton.jit
    def _combine_slots_kernel(slot_ptr, ids_ptr, rows, world, W_P2: tl.constexpr):
        """One program a row: the ranks' summed slots [world, rows, 4] in rank order (shards in index order), to the
        id of the first rank holding the largest key."""
        row = tl.program_id(0).to(tl.int64)
        ws = tl.arange(0, W_P2)
        ok = ws < world
        at = (ws * rows + row) * 4
        key = (tl.load(slot_ptr + at, mask=ok, other=0.0).to(tl.int64) * 65536
               + tl.load(slot_ptr + at + 1, mask=ok, other=0.0).to(tl.int64))
        index = (tl.load(slot_ptr + at + 2, mask=ok, other=0.0).to(tl.int64) * 65536
                 + tl.load(slot_ptr + at + 3, mask=ok, other=0.0).to(tl.int64))
        key = tl.where(ok, key, -1)
        top = tl.max(key, axis=0)
        first = tl.min(tl.where(key == top, ws, W_P2), axis=0)
        tl.store(ids_ptr + row, tl.sum(tl.where(ws == first, index, 0), axis=0))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, V] (a contiguous last dim) -> [B] int64, torch.argmax(x, dim=-1)'s answer, in one launch; written into
    `out` ([B] int64, unit stride) where given, e.g. the rows the next decode step reads its pending tokens from."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use torch.argmax")
    if x.dim() != 2 or x.stride(-1) != 1 or not takes(x):
        raise ValueError(f"argmax_rows takes [batch <= {MAX_COUNTERS}, vocab] fp16/bf16/fp32 rows with a contiguous "
                         f"last dim, got {tuple(x.shape)} {x.dtype}")
    batch, vocab = x.shape
    check_ids_out(out, batch, x.device, "argmax_rows' out", unit_stride=True)
    ids = torch.empty(batch, dtype=torch.int64, device=x.device) if out is None else out
    if batch == 0:
        return ids
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    _launch(x, ids, ids, base=0, rank=0, world=1, use_slots=False)
    return ids


def _launch(x: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, base: int, rank: int, world: int,
            use_slots: bool) -> None:
    batch, vocab = x.shape
    chunks = triton.cdiv(vocab, CHUNK)
    # the three partials in one allocation (a step calls this between its graphs): fp32 maxima, int32 indices, flags,
    # each from a 16-byte boundary: Triton keys a pointer's alignment, so partials packed end to end would compile a
    # variant for each batch size mod 4 (a served batch of 2 greedy rows compiled one in its time to first token)
    cells = batch * chunks
    parts = torch.empty(3, -(-cells // 4) * 4, dtype=torch.float32, device=x.device)
    part_best = parts[0, :cells]
    part_idx, part_nan = parts[1, :cells].view(torch.int32), parts[2, :cells].view(torch.int32)
    _argmax_kernel[(batch, chunks)](x, ids, slots, part_best, part_idx, part_nan, split_counters(x.device, batch),
                                    vocab, x.stride(0), chunks, base, rank, world, batch, CHUNK=CHUNK,
                                    CHUNKS_P2=triton.next_power_of_2(chunks), SLOTS=use_slots, num_warps=4)


def check_slot_inputs(x: torch.Tensor, base: int, rank: int, world: int) -> None:
    """Refuse a shard the slots cannot describe exactly: a type compared in fp32, global indices within int32, and a
    rank of the world."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"shard_argmax_slots takes [batch, vocab shard] fp16/bf16/fp32 rows, got {tuple(x.shape)} "
                         f"{x.dtype}")
    if base < 0 or base + x.shape[1] > MAX_SLOT_INDEX:
        raise ValueError(f"a vocabulary shard at [{base}, {base + x.shape[1]}) passes the slots' int32 index "
                         f"(at most {MAX_SLOT_INDEX})")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")


def shard_argmax_slots_triton(x: torch.Tensor, base: int, rank: int, world: int) -> torch.Tensor:
    """x [B, V] (a contiguous last dim, V >= 1, B within the counters) -> slots [world, B, 4] fp32: zeros but in
    slot `rank`, which holds each row's key (of its maximum, NaN above all) and base + the index of its first NaN
    or first maximum, as 16-bit halves (slot_words)."""
    check_slot_inputs(x, base, rank, world)
    if x.stride(-1) != 1 or x.shape[0] > MAX_COUNTERS or x.shape[1] == 0:
        raise ValueError(f"shard_argmax_slots_triton takes [batch <= {MAX_COUNTERS}, vocab >= 1] rows with a "
                         f"contiguous last dim, got {tuple(x.shape)} with strides {x.stride()}")
    slots = torch.empty(world, x.shape[0], 4, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _launch(x, slots, slots, base, rank, world, use_slots=True)
    return slots


def combine_slots_triton(slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """slots [world, B, 4] fp32 (every rank's shard_argmax_slots, summed over the ranks) -> [B] int64: the index
    torch.argmax gives over the concatenated shards (the first NaN, else the first maximum)."""
    world, batch, _ = slots.shape
    check_ids_out(out, batch, slots.device, "combine_slots' out", unit_stride=True)
    ids = torch.empty(batch, dtype=torch.int64, device=slots.device) if out is None else out
    if batch:
        _combine_slots_kernel[(batch,)](slots.contiguous(), ids, batch, world, W_P2=triton.next_power_of_2(world),
                                        num_warps=1)
    return ids
