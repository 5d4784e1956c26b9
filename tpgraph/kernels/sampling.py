"""Temperature, top-p and min-p sampling without a sort, in up to four Triton launches (on CUDA by default;
TPGRAPH_FUSED_SAMPLING=0 keeps engine/sampler.py's torch chain).

The torch chain sorts every row to find top-p's cut and runs dozens of [B, V] kernels around it: at batch 32 over
Llama-3's 128256 tokens that was 596 µs of kernels and 57 launches a step (bench/results/2026-12-04_h200_fused_
sampling). Here a row is drawn by rejection, as FlashInfer's sampling kernels draw, each row cut into chunks of CHUNK
entries, one program a chunk, and the chunk that arrives last at a row's count (kernels/_counters.py) finishing it:

1. The race launch: each chunk's maximum, its total weight exp((x - max) / T), a draw from it (the inverse of the
   weights' running sum at a uniform), and its key in a race between chunks (log(total) - log(E), E ~ Exp(1)): two
   random numbers a chunk from Philox keyed by the row's seed, the round and the chunk's index; relative to the
   chunk's maximum so that small temperatures keep their precision. Logits below the row's floor (top-k's k-th
   largest: kernels/top_k.py) count as -inf throughout. The last chunk takes the row's maximum m, total S and the
   race's winner over the chunks' keys (moved to the largest maximum), a chunk drawn in proportion to its weight,
   whose draw j is then a draw of exp(x_j / T) / S. A row without top-p or min-p ends here. (Weighed per chunk
   rather than keyed per entry, as a race over every entry would be, a launch needs no per-entry Philox and logs.)
2. The check launch: each chunk's weight above x_j (and, with min-p and top-p, the weight min-p keeps: S' instead of
   S below, as vLLM applies min-p first). The last chunk keeps j when its weight w_j = exp((x_j - m) / T) is at least
   min_p and the weight above it is below p * S: j is then in the kept set, min-p's, and within it the smallest set
   of the largest tokens whose share reaches p, ties at its last value kept (engine/sampler's chain: min-p, then
   top_p_keep).
3. A rejected j lies below the kept set, so the second race (and check) runs over the logits above it whose weight is
   at least min_p, with fresh random numbers. A race over a superset of the kept set, kept when it lands in the set,
   draws from the set in proportion to the weights: the kept distribution, exactly. Without min-p a row keeps the
   first race's winner with probability at least p; the second race, over the logits min-p keeps, too.
4. A row rejected twice runs further rounds in its last chunk's program alone, over the
   whole row, each also weighing the midpoint between the last rejected logit and the lowest known kept one, which
   bisects the gap where races land low.

Every rank runs the same launches on the same logits with the same seeds, so every rank draws the same token. Each row
draws from its own seed (a seeded request's seed for its position, or one taken from the sampler's generator), and
its random numbers follow the chunk's index and the round, so a row's token does not depend on the rest of the batch.

"Exactly" up to the uniforms' 23 bits and fp32 sums: E lies in [6e-8, 16.6], so a chunk whose weight is below e^-19.4
(4e-9) of the largest chunk's never wins, and within a chunk the uniform resolves weights to 2^-23 of its total.
"""

from __future__ import annotations

import torch

from tpgraph.kernels._alignment import aligned
from tpgraph.kernels._counters import MAX_COUNTERS, split_counters
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.argmax import check_ids_out

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._counters import arrived_last, reset_counter
except ImportError:  # CPU-only installs without Triton use the torch chain
    triton = None

CHUNK = 2048  # entries a program takes (a 128256-entry row: 63 programs)
WARPS = 4  # a program's warps
MAX_ROUNDS = 48  # races before a row takes its largest logit (never seen: each round bisects the gap at least)
SEED_HIGH = 1 << 62  # the drawn seeds' range: [0, SEED_HIGH)
ROWS_PER_LAUNCH = MAX_COUNTERS  # a launch's rows: one arrival counter each
ROUND_COUNTERS = 1 << 22  # Philox counters a round (one a chunk: more than any vocabulary below 2^24 has)
# a row's state between launches, fp32 words: its maximum, p * total (inf without top-p; with min-p, p of what it
# keeps, from the first check on), the drawn logit, the logit at or below which nothing is kept, one above which all
# is (its maximum, for the bisection), whether the row is drawn, and a spare word (8 a row keep the partials after
# them at a 16-byte boundary: _alignment.py)
M, SHARE, XJ, LOW, HIGH, DONE = range(6)
STATE_WORDS = 8


def fused_sampling_enabled() -> bool:
    """Whether the sampler draws non-greedy rows with these kernels on CUDA: yes unless TPGRAPH_FUSED_SAMPLING=0."""
    return env_flag("TPGRAPH_FUSED_SAMPLING", default=True)


if triton is not None:
    _LOG2E = tl.constexpr(1.4426950408889634)
    # the whole-row loops of rounds 3 and on, in one program: their loads run this many blocks ahead (through shared
    # memory), or each block's load waits for the one before
    _ROUND_STAGES = tl.constexpr(3)
    _M, _SHARE, _XJ, _LOW, _HIGH, _DONE, _WORDS = (tl.constexpr(i) for i in (M, SHARE, XJ, LOW, HIGH, DONE,
                                                                             STATE_WORDS))

    @triton.jit
    def _logits(row_ptr, offs, V, floor):
        """A block of the row's logits in fp32; NaN, those below `floor` (top-k's) and entries past V as -inf (never
        drawn, no weight)."""
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        return tl.where((x == x) & (x >= floor), x, float("-inf"))

    @triton.jit
    def _finite_or_zero(v):
        return tl.where((v > float("-inf")) & (v < float("inf")), v, 0.0)

    @triton.jit
    def _weight(x, m, inv_t):
        """exp((x - m) / T): a logit's probability up to the row's factor (1 at the maximum m)."""
        return tl.exp2((x - m) * (inv_t * _LOG2E))

    @triton.jit
    def _may_draw(x, w, low, min_p):
        """Whether a later race may draw the logit x of weight w (relative to the row's maximum): above `low`, with
        weight at least min_p."""
        return (x > low) & (w >= min_p)

    @triton.jit
    def _kept_by_race(x, m, low, inv_t, min_p):
        """x where a later race may draw it, else -inf."""
        return tl.where(_may_draw(x, _weight(x, m, inv_t), low, min_p), x, float("-inf"))

    @triton.jit
    def _weights_above(x, m, inv_t, a):
        return tl.sum(tl.where(x > a, _weight(x, m, inv_t), 0.0), axis=0)

    @triton.jit
    def _uniform(bits):
        """23 random bits and a half: a uniform strictly inside (0, 1)."""
        return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def _first_past(running, w, target, N: tl.constexpr):
        """The first weighed entry whose running sum passes target, or where none does (a target that rounded up to
        the total) the last weighed one. (Only a weighed entry: a parallel scan may step its sums up an ulp on a
        zero.)"""
        at = tl.arange(0, N)
        pick = tl.min(tl.where((running > target) & (w > 0.0), at, N), axis=0)
        return tl.where(pick < N, pick, tl.maximum(tl.max(tl.where(w > 0.0, at, -1), axis=0), 0))

    @triton.jit
    def _pick(w, u, N: tl.constexpr):
        """The entry at which the N weights' running sum first passes u (in (0, 1)) times their total: a draw in
        proportion to w -> (the entry, the total)."""
        running = tl.cumsum(w, axis=0)
        total = tl.max(running, axis=0)  # (the sums only grow)
        return _first_past(running, w, u * total, N), total

    @triton.jit
    def _chunk_draw(x, seed, counter, inv_t, N: tl.constexpr):
        """A draw from the N logits x (-inf: out) in proportion to exp(x / T) -> (its index among them, the chunk's
        race key, its total weight, its maximum cm). The index comes from the inverse of the weights' running sum
        (relative to cm) at a uniform; the key is log(total) - log(E), E ~ Exp(1), relative to cm (-inf for a chunk
        of -inf, +inf for one holding +inf, which draws its first +inf): the winner of a race over the chunks' keys,
        moved to one scale, is a chunk drawn in proportion to its weight, so its draw is one from the whole row. Two
        random numbers a chunk, from Philox at `counter`."""
        cm = tl.max(x, axis=0)
        finite = (cm > float("-inf")) & (cm < float("inf"))
        r0, r1, _, _ = tl.randint4x(seed, counter, 10)
        pick, total = _pick(tl.where(finite, _weight(x, _finite_or_zero(cm), inv_t), 0.0), _uniform(r0), N)
        pick = tl.where(cm == float("inf"), tl.min(tl.where(x == float("inf"), tl.arange(0, N), N), axis=0), pick)
        key = tl.where(finite, tl.log(total) - tl.log(-tl.log(_uniform(r1))), cm)
        return pick, key, total, cm

    @triton.jit
    def _kept_weights(row_ptr, start, V, floor, m, low, inv_t, min_p, BLOCK: tl.constexpr):
        """The weights (relative to the row's maximum m) of the block's logits a later race may draw: above `low`,
        weight at least min_p; 0 for the rest."""
        x = _logits(row_ptr, start + tl.arange(0, BLOCK), V, floor)
        w = _weight(x, m, inv_t)
        return tl.where(_may_draw(x, w, low, min_p), w, 0.0)

    @triton.jit
    def _race_row(row_ptr, V, floor, seed, counter_base, inv_t, m, low, min_p, BLOCK: tl.constexpr):
        """One program's draw from the whole row's logits above `low` with weight at least min_p: a block by a race
        between the blocks' total weights, then an entry of it by the inverse of its running sum, each with the
        block's Philox numbers (one reduction a block in the pass over the row; the running sum for one block)."""
        best = tl.full((), float("-inf"), tl.float32)
        best_start = tl.full((), 0, tl.int32)
        for start in tl.range(0, V, BLOCK, num_stages=_ROUND_STAGES):
            total = tl.sum(_kept_weights(row_ptr, start, V, floor, m, low, inv_t, min_p, BLOCK), axis=0)
            _, r1, _, _ = tl.randint4x(seed, counter_base + start // BLOCK, 10)
            key = tl.log(total) - tl.log(-tl.log(_uniform(r1)))  # (-inf for a block with nothing to draw)
            best_start = tl.where(key > best, start, best_start)  # (no branch: the loop's loads stay pipelined)
            best = tl.maximum(best, key)
        r0, _, _, _ = tl.randint4x(seed, counter_base + best_start // BLOCK, 10)
        w = _kept_weights(row_ptr, best_start, V, floor, m, low, inv_t, min_p, BLOCK)
        return best_start + _pick(w, _uniform(r0), BLOCK)[0]

    @triton.jit
    def _weight_above_row(row_ptr, V, floor, m, inv_t, a, b, BLOCK: tl.constexpr):
        """One program's sums over the whole row: the weight above `a`, and above `b` (added lane by lane, then
        across the lanes once)."""
        above_a = tl.zeros((BLOCK,), tl.float32)
        above_b = tl.zeros((BLOCK,), tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=_ROUND_STAGES):
            x = _logits(row_ptr, start + tl.arange(0, BLOCK), V, floor)
            w = _weight(x, m, inv_t)
            above_a += tl.where(x > a, w, 0.0)
            above_b += tl.where(x > b, w, 0.0)
        return tl.sum(above_a, axis=0), tl.sum(above_b, axis=0)

    @triton.jit
    def _first_max(row_ptr, V, floor, m, BLOCK: tl.constexpr):
        """The first index of the logit m in the row."""
        first = tl.full((BLOCK,), V, tl.int32)
        for start in tl.range(0, V, BLOCK, num_stages=_ROUND_STAGES):
            offs = start + tl.arange(0, BLOCK)
            first = tl.minimum(first, tl.where(_logits(row_ptr, offs, V, floor) == m, offs, V))
        return tl.min(first, axis=0)

    @triton.jit
    def _more_rounds(row_ptr, V, floor, seed, round_stride, inv_t, m, share, min_p, low, high,
                     MAX_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
        """Rounds 2 and on, in one program: a race above `low`, its check, and the pivot's weight, until a draw is
        kept (after MAX_ROUNDS the row's first maximum, which always is)."""
        pivot = tl.where(low > float("-inf"), low + (high - low) * 0.5, high)
        j = tl.full((), 0, tl.int32)
        rounds = 2
        done = 0
        while done == 0:
            if rounds >= MAX_ROUNDS:
                j = _first_max(row_ptr, V, floor, m, BLOCK)
                done = 1
            else:
                j = _race_row(row_ptr, V, floor, seed, rounds * round_stride, inv_t, m, low, min_p, BLOCK)
                rounds += 1
                xj = tl.load(row_ptr + j).to(tl.float32)
                above_j, above_pivot = _weight_above_row(row_ptr, V, floor, m, inv_t, xj, pivot, BLOCK)
                if (_weight(xj, m, inv_t) >= min_p) & (above_j < share):
                    done = 1
                else:
                    low = tl.maximum(low, xj)
                    if above_pivot >= share:
                        low = tl.maximum(low, pivot)
                    else:
                        high = tl.minimum(high, pivot)
                    pivot = tl.where(low > float("-inf"), low + (high - low) * 0.5, high)
        return j

    @triton.jit
    def _race_kernel(x_ptr, stride_x, V, param_ptr, seed_ptr, ids_ptr, state_ptr, part_ptr,
                     counter_ptr, chunks, round_stride, SECOND: tl.constexpr, CHUNK: tl.constexpr,
                     CHUNKS_P2: tl.constexpr):
        """Grid (rows, chunks): a race over the chunk (SECOND: the second round's, above the state's low, for rows
        not yet drawn), and in the row's last chunk the winner over the chunks (and without SECOND, the row's
        maximum and total, and whether it is drawn already)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        t = tl.load(param_ptr + row * 4)
        state = state_ptr + row * _WORDS
        if SECOND:
            todo = (t > 0.0) & (tl.load(state + _DONE) == 0.0)
        else:
            todo = t > 0.0
        if todo:  # (greedy rows and drawn ones: every chunk leaves, and their count stays at zero)
            inv_t = 1.0 / t
            seed = tl.load(seed_ptr + row)
            row_ptr = x_ptr + row * stride_x
            start = c * CHUNK
            x = _logits(row_ptr, start + tl.arange(0, CHUNK), V, tl.load(param_ptr + row * 4 + 3))
            part = part_ptr + (row * chunks + c) * 4
            if SECOND:
                m = tl.load(state + _M)
                x = _kept_by_race(x, m, tl.load(state + _LOW), inv_t, tl.load(param_ptr + row * 4 + 2))
            pick, key, total, cm = _chunk_draw(x, seed, SECOND * round_stride + c, inv_t, CHUNK)
            if SECOND:  # (m is finite: a row of -inf or holding +inf is drawn in the first round)
                key = key + (_finite_or_zero(cm) - m) * inv_t
            else:  # keys relative to the chunk's own maximum: the last program moves them to the largest
                tl.store(part + 2, cm)
                tl.store(part + 3, total)
            tl.store(part, key)
            tl.store(part + 1, (start + pick).to(tl.float32))  # (exact below 2^24)
            if arrived_last(counter_ptr + row, chunks):
                cs = tl.arange(0, CHUNKS_P2)
                ok = cs < chunks
                parts = part_ptr + (row * chunks + cs) * 4
                keys = tl.load(parts, mask=ok, other=float("-inf"), cache_modifier=".cg")
                if not SECOND:  # each chunk's keys were relative to its own (finite) maximum: to the largest of them
                    maxima = tl.load(parts + 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    finite = (maxima > float("-inf")) & (maxima < float("inf"))
                    top = _finite_or_zero(tl.max(tl.where(finite, maxima, float("-inf")), axis=0))
                    keys = keys + (_finite_or_zero(maxima) - top) * inv_t
                best = tl.max(keys, axis=0)
                first = tl.min(tl.where(ok & (keys == best), cs, CHUNKS_P2), axis=0)
                winners = tl.load(parts + 1, mask=ok, other=0.0, cache_modifier=".cg")
                j = tl.sum(tl.where(cs == first, winners, 0.0), axis=0).to(tl.int32)
                if not SECOND:
                    totals = tl.load(parts + 3, mask=ok, other=0.0, cache_modifier=".cg")
                    m = tl.max(maxima, axis=0)
                    total = tl.sum(tl.where(maxima > float("-inf"), totals * _weight(maxima, m, inv_t), 0.0), axis=0)
                    p = tl.load(param_ptr + row * 4 + 1)
                    min_p = tl.load(param_ptr + row * 4 + 2)
                    # a row of -inf (or NaN) only has no weights: its first index, as the torch chain's argmax gives
                    j = tl.where(m == float("-inf"), 0, j)
                    done = ((p >= 1.0) & (min_p <= 0.0)) | (m == float("-inf")) | (m == float("inf"))
                    tl.store(state + _M, m)
                    # (a p that rounded to 0 in fp32 keeps the largest, and its ties, as the smallest p would)
                    tl.store(state + _SHARE, tl.where(p < 1.0, tl.maximum(p * total, 1e-30), float("inf")))
                    tl.store(state + _LOW, float("-inf"))
                    tl.store(state + _HIGH, m)
                    tl.store(state + _DONE, done.to(tl.float32))
                tl.store(state + _XJ, tl.load(row_ptr + j).to(tl.float32))
                tl.store(ids_ptr + row, j.to(tl.int64))
                reset_counter(counter_ptr + row)

    @triton.jit
    def _check_kernel(x_ptr, stride_x, V, param_ptr, seed_ptr, ids_ptr, state_ptr, part_ptr, counter_ptr, chunks,
                      round_stride, LAST: tl.constexpr, MAX_ROUNDS: tl.constexpr, CHUNK: tl.constexpr,
                      CHUNKS_P2: tl.constexpr):
        """Grid (rows, chunks): the chunk's weight above the drawn logit, and in the row's last chunk the verdict; a
        rejected draw's logit becomes the row's low, and with LAST the row runs its further rounds there. The first
        check (not LAST) also sums what min-p keeps of the chunk: with min-p, top-p's share becomes p of that (min-p
        first, as vLLM's V1 orders them), before its verdict."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        t = tl.load(param_ptr + row * 4)
        state = state_ptr + row * _WORDS
        if (t > 0.0) & (tl.load(state + _DONE) == 0.0):
            inv_t = 1.0 / t
            row_ptr = x_ptr + row * stride_x
            m = tl.load(state + _M)
            xj = tl.load(state + _XJ)
            floor = tl.load(param_ptr + row * 4 + 3)
            min_p = tl.load(param_ptr + row * 4 + 2)
            x = _logits(row_ptr, c * CHUNK + tl.arange(0, CHUNK), V, floor)
            part = part_ptr + (row * chunks + c) * 2
            tl.store(part, _weights_above(x, m, inv_t, xj))
            if not LAST:  # the chunk's weight that min-p keeps: top-p's share is of it (vLLM's order)
                w = _weight(x, m, inv_t)
                tl.store(part + 1, tl.sum(tl.where(w >= min_p, w, 0.0), axis=0))
            if arrived_last(counter_ptr + row, chunks):
                cs = tl.arange(0, CHUNKS_P2)
                parts = part_ptr + (row * chunks + cs) * 2
                above = tl.sum(tl.load(parts, mask=cs < chunks, other=0.0, cache_modifier=".cg"), axis=0)
                share = tl.load(state + _SHARE)
                if not LAST:
                    p = tl.load(param_ptr + row * 4 + 1)
                    if (p < 1.0) & (min_p > 0.0):  # (the race's share was p of the whole row's weight)
                        kept = tl.sum(tl.load(parts + 1, mask=cs < chunks, other=0.0, cache_modifier=".cg"), axis=0)
                        share = tl.maximum(p * kept, 1e-30)
                        tl.store(state + _SHARE, share)
                if (_weight(xj, m, inv_t) >= min_p) & (above < share):
                    tl.store(state + _DONE, 1.0)
                else:
                    low = tl.maximum(tl.load(state + _LOW), xj)
                    tl.store(state + _LOW, low)
                    if LAST:
                        j = _more_rounds(row_ptr, V, floor, tl.load(seed_ptr + row), round_stride, inv_t, m, share,
                                         min_p, low, tl.load(state + _HIGH), MAX_ROUNDS, CHUNK)
                        tl.store(ids_ptr + row, j.to(tl.int64))
                        tl.store(state + _DONE, 1.0)
                reset_counter(counter_ptr + row)


def check_rows(caller: str, x: torch.Tensor, *per_row: tuple[str, torch.Tensor, tuple[int, ...], torch.dtype]
               ) -> tuple[int, int]:
    """Refuse, naming `caller`, logits that are not [batch, vocab] fp32/bf16/fp16 with a contiguous last dim, or a
    per-row tensor (name, tensor, its dims after the batch's, dtype) of another shape, dtype or device -> (batch,
    vocab)."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{caller} takes [batch, vocab] fp32/bf16/fp16 logits with a contiguous last dim, got "
                         f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}")
    batch, vocab = x.shape
    for name, t, dims, dtype in per_row:
        shape = (batch, *dims)
        if t.shape != shape or t.dtype != dtype or t.device != x.device:
            raise ValueError(f"{caller}'s {name} must be {list(shape)} {dtype} on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    return batch, vocab


def chunk_for(vocab: int, chunk: int = CHUNK) -> int:
    """`chunk` entries a program, or the smallest power of two holding a shorter row (at least 16)."""
    return max(16, min(chunk, triton.next_power_of_2(vocab)))


def sample_rows(x: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor | None = None,
                truncated: bool = True) -> torch.Tensor:
    """x [B, V] logits (fp32/bf16/fp16, a contiguous last dim; -inf for tokens a row may not take), params [B, 4]
    fp32 per row (temperature, 0 for greedy rows, which are left to the caller; top_p in (0, 1]; min_p in [0, 1];
    a floor below which logits are out, top-k's k-th largest, or -inf) and [B] int64 seeds -> [B] int64 drawn ids
    (greedy rows keep what `out` held, or garbage). `truncated`: whether any row may have top-p below 1 or min-p
    above 0 (False: the race alone, the check launches skipped; top-k's floor needs no check)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; sample with the torch chain")
    batch, vocab = check_rows("sample_rows", x, ("params", params, (4,), torch.float32),
                              ("seeds", seeds, (), torch.int64))
    if vocab >= 1 << 24:
        raise ValueError(f"sample_rows carries indices in fp32: a vocabulary below 2^24, got {vocab}")
    check_ids_out(out, batch, x.device, "sample_rows' out")
    ids = torch.empty(batch, dtype=torch.int64, device=x.device) if out is None else out
    if vocab == 0:
        return ids
    params, seeds = aligned(params), aligned(seeds)
    drawn = aligned(ids)  # (a copy where `out` is strided or off the boundary, its ids copied back)
    for first in range(0, batch, ROWS_PER_LAUNCH):
        rows = slice(first, first + ROWS_PER_LAUNCH)
        _launch(x[rows], params[rows], seeds[rows], drawn[rows], truncated)
    return ids if drawn is ids else ids.copy_(drawn)


def _launch(x: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, ids: torch.Tensor, truncated: bool) -> None:
    batch, vocab = x.shape
    chunk = chunk_for(vocab, CHUNK)
    chunks = triton.cdiv(vocab, chunk)
    # one allocation: the rows' states, then the chunks' partials (4 words each)
    work = torch.empty(batch * (STATE_WORDS + 4 * chunks), dtype=torch.float32, device=x.device)
    state, parts = work[:batch * STATE_WORDS], work[batch * STATE_WORDS:]
    counters = split_counters(x.device, batch)
    args = (x, x.stride(0), vocab, params, seeds, ids, state, parts, counters, chunks, ROUND_COUNTERS)
    grid = (batch, chunks)
    common = dict(CHUNK=chunk, CHUNKS_P2=triton.next_power_of_2(chunks), num_warps=WARPS)
    _race_kernel[grid](*args, SECOND=False, **common)
    if truncated:
        _check_kernel[grid](*args, LAST=False, MAX_ROUNDS=MAX_ROUNDS, **common)
        _race_kernel[grid](*args, SECOND=True, **common)
        _check_kernel[grid](*args, LAST=True, MAX_ROUNDS=MAX_ROUNDS, **common)
