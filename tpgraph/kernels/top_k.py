"""Each row's top-k floor (its k-th largest logit) in two Triton launches, instead of torch.topk
(kernels/sampling.py leaves out what is below the floor).

torch.topk over Llama-3's 128256 tokens took 40-60 µs of the fused draw's kernel time at batches 1-32, against 16-43
µs for the rest of it (bench/results/2026-12-04_h200_fused_sampling). A radix select over the whole row in two
launches of 256-bin histograms cost 14-44 µs (bench/results/2026-12-04_h200_top_k, run2): Triton's histogram takes
some 60 instructions an entry. Here the histograms only see a few candidates (the logits at or above a bound):

1. The bound launch: each chunk of a row (one program each) splits into PARTS parts and keeps its TOP largest part
   maxima. The row's last chunk (kernels/_counters.py) takes, over the full chunks, the least of their m-th largest,
   m = ceil(k / full chunks): with m logits of every full chunk at or above it, at least k are, so it is at most the
   k-th largest logit, and usually not far below it. Where a full chunk has fewer than m parts holding a logit (masked
   ids), that least is -inf, and the bound is the k-th largest of all the chunks' kept maxima instead (any k of them
   are k distinct logits).
2. The gather launch: each chunk appends its logits at or above the bound (keys that order as the values do) to the
   row's candidates; the last chunk finds the k-th largest candidate by radix select over their keys, 8 bits at a
   time, in its own program. Every logit at or above the k-th largest is a candidate, so that is the row's k-th
   largest: the floor, with ties at it kept, as torch.topk's k-th value keeps them in engine/sampler.top_k_mask.

Any k is exact, but a row with more than CANDIDATES candidates selects over the whole row in one program, hundreds
of µs: from ties at the top, from masks that leave fewer than k maxima among those kept, or from k well past MAX_K,
where the bound loosens (the sampler takes torch.topk there).

NaN and -inf are never candidates: a row with fewer than k other logits keeps everything, its floor -inf, as it
does where k is 0. (torch.topk would count NaN above everything; the draw never takes NaN.)
"""

from __future__ import annotations

import torch

from tpgraph.kernels._alignment import aligned
from tpgraph.kernels._counters import MAX_COUNTERS, split_counters
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.sampling import check_rows, chunk_for

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._counters import arrived_last, reset_counter
except ImportError:  # CPU-only installs without Triton use engine/sampler.top_k_floor's torch.topk
    triton = None

CHUNK = 4096  # entries a program reads (a 128256-entry row: 32 programs)
MAX_K = 256  # the largest k taken here (larger: the caller's torch.topk)
MAX_PARTS = 256  # parts a chunk's bound takes the maxima of, at most (a sort of them in each program)
CANDIDATES = 4096  # a row's candidate slots
SELECT_BLOCK = 1024  # keys a histogram of the radix select takes at once
SMALL_SELECT_BLOCK = 256  # ... where that many hold a row's candidates
BOUND_WARPS = 4  # warps a program (bench/results/2026-12-04_h200_top_k: 1 or 2 lost at batch 1, run8)
GATHER_WARPS = 8  # (its last program's histograms: 8 took 1-3.5 µs off at batch 1, run9; 1 or 2 lost, run8)
ROWS_PER_LAUNCH = MAX_COUNTERS // 2  # a row takes two counters: its arrivals, and its candidates' count that many on


def fused_top_k_enabled() -> bool:
    """Whether the fused draw (engine/sampler.Sampler) finds top-k's floor here (k up to MAX_K): yes unless
    TPGRAPH_FUSED_TOP_K=0, which keeps torch.topk."""
    return env_flag("TPGRAPH_FUSED_TOP_K", default=True)


if triton is not None:
    _NEG_INF = tl.constexpr(float("-inf"))
    _ROWS = tl.constexpr(ROWS_PER_LAUNCH)

    @triton.jit
    def _keys(x, KEY_BITS: tl.constexpr):
        """Unsigned keys (uint32) in x's bit width that order as x's values do (-0 just below +0)."""
        if KEY_BITS == 16:
            bits = x.to(tl.int16, bitcast=True).to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            bits = x.to(tl.uint32, bitcast=True)
        sign = tl.full((), 1 << (KEY_BITS - 1), tl.uint32)
        ones = tl.full((), (1 << KEY_BITS) - 1, tl.uint32)
        return tl.where((bits & sign) != 0, bits ^ ones, bits | sign)

    @triton.jit
    def _value(key, x_ptr, KEY_BITS: tl.constexpr):
        """The logit whose key `key` is, as fp32."""
        sign = tl.full((), 1 << (KEY_BITS - 1), tl.uint32)
        ones = tl.full((), (1 << KEY_BITS) - 1, tl.uint32)
        bits = tl.where((key & sign) != 0, key ^ sign, key ^ ones)
        if KEY_BITS == 16:
            return bits.to(tl.uint16).to(tl.int16, bitcast=True).to(x_ptr.dtype.element_ty, bitcast=True).to(
                tl.float32)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _chunk(row_ptr, offs, V):
        """A block of the row as stored, and in fp32 with NaN and the entries past V as -inf."""
        raw = tl.load(row_ptr + offs, mask=offs < V, other=_NEG_INF)
        v = raw.to(tl.float32)  # (NaN tested in fp32: the interpreter compares 16-bit floats by their bits)
        return raw, tl.where(v == v, v, _NEG_INF)

    @triton.jit
    def _row_k(k_ptr, row, V):
        """The row's k as int32, clamped to V + 1 (past V all are kept; a k of 2^31 or inf would overflow)."""
        return tl.minimum(tl.load(k_ptr + row), V + 1.0).to(tl.int32)

    @triton.jit
    def _bound_kernel(x_ptr, stride_x, V, k_ptr, floor_ptr, stride_floor, part_ptr, counter_ptr, chunks,
                      CHUNK: tl.constexpr, PARTS: tl.constexpr, TOP: tl.constexpr, CHUNKS_P2: tl.constexpr,
                      UNION: tl.constexpr):
        """Grid (rows, chunks): the chunk's TOP largest part maxima (of PARTS), in order; in the row's last chunk a
        lower bound of the floor into the floor column, which the gather launch replaces:
        - the least over the counted chunks (the full ones, or the only one) of their m-th largest part maximum,
          m = ceil(k / counted): m logits of each counted chunk, at least k in all, are at or above it. (A partial
          last chunk's parts past V hold no logit, so its m-th would often be -inf, and with it the least.)
        - where that is -inf (a counted chunk with fewer than m parts holding a logit: masked ids, or k past MAX_K),
          the k-th largest of all the chunks' TOP largest part maxima, any k of which are k distinct logits."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        k = _row_k(k_ptr, row, V)
        if k <= 0:
            if c == 0:
                tl.store(floor_ptr + row * stride_floor, _NEG_INF)
        else:
            _, x = _chunk(x_ptr + row * stride_x, c * CHUNK + tl.arange(0, CHUNK), V)
            maxima = tl.sort(tl.max(tl.reshape(x, [PARTS, CHUNK // PARTS]), axis=1), descending=True)
            at = tl.arange(0, PARTS)
            parts = part_ptr + row * chunks * TOP
            tl.store(parts + c * TOP + at, maxima, mask=at < TOP)
            if arrived_last(counter_ptr + row, chunks):
                counted = tl.maximum(V // CHUNK, 1)
                m = (k + counted - 1) // counted
                cs = tl.arange(0, CHUNKS_P2)
                counts_in = (cs < counted) & (cs * 0 + m <= TOP)  # (m past TOP: -inf, the union below; m >= 1)
                mths = tl.load(parts + cs * TOP + m - 1, mask=counts_in, other=_NEG_INF, cache_modifier=".cg")
                bound = tl.min(tl.where(cs < counted, mths, float("inf")), axis=0)
                if bound == _NEG_INF:
                    u = tl.arange(0, UNION)
                    union = tl.load(parts + u, mask=u < chunks * TOP, other=_NEG_INF, cache_modifier=".cg")
                    ordered = tl.sort(union, descending=True)
                    bound = tl.sum(tl.where(u == k - 1, ordered, 0.0), axis=0)  # (-inf past the union)
                    bound = tl.where(k <= chunks * TOP, bound, _NEG_INF)
                tl.store(floor_ptr + row * stride_floor, bound)
                reset_counter(counter_ptr + row)

    @triton.jit
    def _digit_counts(key, ok, settled, shift: tl.constexpr, KEY_BITS: tl.constexpr):
        """The histogram of the keys' 8 bits above `shift`, of those (where ok) whose bits above match `settled`."""
        if shift + 8 < KEY_BITS:  # (a shift by the whole width is undefined)
            ok = ok & ((key >> (shift + 8)) == settled)
        return tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=ok)

    @triton.jit
    def _settle(counts, settled, rank):
        """The next 8 bits of the rank-th largest key, from its digit's histogram; and its rank among the keys that
        share the bits settled so far."""
        at_or_above = tl.cumsum(counts, axis=0, reverse=True)
        digit = tl.sum((at_or_above >= rank).to(tl.int32), axis=0) - 1
        rank -= tl.sum(tl.where(tl.arange(0, 256) > digit, counts, 0), axis=0)
        return settled * 256 + digit.to(tl.uint32), rank

    @triton.jit
    def _kth_key(ptr, n, k, low, SOURCE: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
        """The k-th largest key among n candidates, by radix select in one program: 8 bits a round, each a histogram
        of the keys that match the bits settled so far. SOURCE 0: n <= BLOCK keys at ptr, read once; 1: n keys at
        ptr, read a block at a time; 2: the keys of a row of n logits at or above `low` (NaN and -inf left out)."""
        settled = tl.full((), 0, tl.uint32)
        rank = k
        i = tl.arange(0, BLOCK)
        if SOURCE == 0:
            ok = i < n
            key = tl.load(ptr + i, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            for p in tl.static_range(KEY_BITS // 8):
                shift = KEY_BITS - 8 * (p + 1)
                settled, rank = _settle(_digit_counts(key, ok, settled, shift, KEY_BITS), settled, rank)
        else:
            for p in tl.static_range(KEY_BITS // 8):
                shift = KEY_BITS - 8 * (p + 1)
                counts = tl.zeros([256], tl.int32)
                for start in range(0, n, BLOCK):
                    if SOURCE == 1:
                        ok = start + i < n
                        key = tl.load(ptr + start + i, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32,
                                                                                                  bitcast=True)
                    else:
                        raw, x = _chunk(ptr, start + i, n)
                        ok = (x >= low) & (x > _NEG_INF)
                        key = _keys(raw, KEY_BITS)
                    counts += _digit_counts(key, ok, settled, shift, KEY_BITS)
                settled, rank = _settle(counts, settled, rank)
        return settled

    @triton.jit
    def _gather_kernel(x_ptr, stride_x, V, k_ptr, floor_ptr, stride_floor, cand_ptr, counter_ptr, chunks,
                       CHUNK: tl.constexpr, KEY_BITS: tl.constexpr, CANDIDATES: tl.constexpr, BLOCK: tl.constexpr,
                       SMALL_BLOCK: tl.constexpr):
        """Grid (rows, chunks): the chunk's logits at or above the bound appended to the row's candidates (their count
        in the second half of the counters: ROWS_PER_LAUNCH on, a constant, so that the kernel does not compile again
        per batch size); in the row's last chunk the k-th largest of them into the floor column."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        k = _row_k(k_ptr, row, V)
        if k > 0:
            low = tl.load(floor_ptr + row * stride_floor)
            row_ptr = x_ptr + row * stride_x
            raw, x = _chunk(row_ptr, c * CHUNK + tl.arange(0, CHUNK), V)
            taken = (x >= low) & (x > _NEG_INF)
            held = counter_ptr + _ROWS + row
            # a slot each (the candidates' order does not matter: few, so the count's atomics stay cheap)
            at = tl.atomic_add(held + tl.zeros([CHUNK], tl.int32), 1, mask=taken, sem="relaxed")
            tl.store(cand_ptr + row * CANDIDATES + at, _keys(raw, KEY_BITS).to(tl.int32, bitcast=True),
                     mask=taken & (at < CANDIDATES))
            if arrived_last(counter_ptr + row, chunks):
                n = tl.atomic_xchg(held, 0)  # (read, and zeroed for the next call)
                cand = cand_ptr + row * CANDIDATES
                if n < k:  # fewer than k logits above -inf: all kept
                    floor = tl.full((), _NEG_INF, tl.float32)
                elif n > CANDIDATES:  # (not all stored)
                    floor = _value(_kth_key(row_ptr, V, k, low, 2, KEY_BITS, BLOCK), x_ptr, KEY_BITS)
                elif n <= SMALL_BLOCK:  # (the histograms' cost follows the block: most rows take few candidates)
                    floor = _value(_kth_key(cand, n, k, low, 0, KEY_BITS, SMALL_BLOCK), x_ptr, KEY_BITS)
                elif n <= BLOCK:
                    floor = _value(_kth_key(cand, n, k, low, 0, KEY_BITS, BLOCK), x_ptr, KEY_BITS)
                else:
                    floor = _value(_kth_key(cand, n, k, low, 1, KEY_BITS, BLOCK), x_ptr, KEY_BITS)
                tl.store(floor_ptr + row * stride_floor, floor)
                reset_counter(counter_ptr + row)


def top_k_floors(x: torch.Tensor, ks: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
    """x [B, V] logits (fp32/bf16/fp16, a contiguous last dim), ks [B] fp32 per row (k; 0 for none; fast up to MAX_K)
    -> `floors` [B] fp32 (may be strided, e.g. a column of kernels/sampling.sample_rows' params): each row's k-th
    largest logit, -inf where k is 0 or the row has fewer than k logits other than NaN and -inf."""
    if triton is None:
        raise RuntimeError("Triton is not installed; find top-k's floor with engine/sampler.top_k_floor")
    batch, vocab = check_rows("top_k_floors", x, ("ks", ks, (), torch.float32), ("floors", floors, (), torch.float32))
    if batch == 0:
        return floors
    if vocab == 0:
        return floors.fill_(float("-inf"))
    ks = aligned(ks)
    chunk = chunk_for(vocab, CHUNK)
    chunks = triton.cdiv(vocab, chunk)
    # a counted chunk's share of MAX_K, and four times that many parts (at most MAX_PARTS: a vocabulary of a chunk or
    # two has few candidates in all, however loose the bound)
    top = triton.next_power_of_2(triton.cdiv(MAX_K, max(vocab // chunk, 1)))
    parts = min(chunk, MAX_PARTS, max(32, 4 * top))
    top = min(top, parts)
    for first in range(0, batch, ROWS_PER_LAUNCH):
        rows = slice(first, first + ROWS_PER_LAUNCH)
        n = min(batch - first, ROWS_PER_LAUNCH)
        # one allocation: the rows' candidates (int32 keys), then the chunks' largest part maxima
        work = torch.empty(n * (CANDIDATES + chunks * top), dtype=torch.int32, device=x.device)
        candidates, maxima = work[:n * CANDIDATES], work[n * CANDIDATES:].view(torch.float32)
        counters = split_counters(x.device, ROWS_PER_LAUNCH + n)  # (arrivals, then candidates' counts)
        args = (x[rows], x.stride(0), vocab, ks[rows], floors[rows], floors.stride(0))
        _bound_kernel[(n, chunks)](*args, maxima, counters, chunks, CHUNK=chunk, PARTS=parts, TOP=top,
                                   CHUNKS_P2=triton.next_power_of_2(chunks),
                                   UNION=triton.next_power_of_2(chunks * top), num_warps=BOUND_WARPS)
        _gather_kernel[(n, chunks)](*args, candidates, counters, chunks, CHUNK=chunk, KEY_BITS=8 * x.element_size(),
                                    CANDIDATES=CANDIDATES, BLOCK=SELECT_BLOCK, SMALL_BLOCK=SMALL_SELECT_BLOCK,
                                    num_warps=GATHER_WARPS)
    return floors
