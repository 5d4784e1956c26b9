"""Each row's top-k floor (its k-th largest logit) by radix select, in two Triton launches from 16-bit logits and four
from fp32, instead of torch.topk (kernels/sampling.py leaves out what is below the floor).

torch.topk over Llama-3's 128256 tokens took 40-60 µs of the fused draw's kernel time at batches 1-32, against 16-43
µs for the rest of it (bench/results/2026-12-04_h200_fused_sampling). Here each logit maps to an unsigned key that
orders as the values do, and each launch settles the next 8 bits of the k-th largest key: every chunk of a row (one
program each) counts its keys that match the bits settled so far into 256 bins of their next 8 bits, adds its counts
to the row's histogram, and the chunk that arrives last at the row's count (kernels/_counters.py) takes the bin where
the k-th largest lies, subtracts what lies above it from k, and clears the histogram for the next launch. After the
last launch the settled key is the k-th largest logit itself: the floor, with ties at it kept, as torch.topk's k-th
value keeps them in engine/sampler.top_k_mask.

NaN counts below -inf, as the draw counts it (never taken). A row whose k is 0 or above its count of logits keeps
everything: its floor is -inf.
"""

from __future__ import annotations

import torch

from tpgraph.kernels._alignment import aligned
from tpgraph.kernels._counters import MAX_COUNTERS, split_counters
from tpgraph.kernels._settings import env_flag

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._counters import arrived_last, reset_counter
except ImportError:  # CPU-only installs without Triton use engine/sampler.top_k_floor's torch.topk
    triton = None

CHUNK = 4096  # entries a program counts (a 128256-entry row: 32 programs)
DIGIT_BITS = 8  # a launch settles 8 bits of the key: 256 bins
ROWS_PER_LAUNCH = MAX_COUNTERS  # one arrival counter a row
STATE_WORDS = 2  # a row's settled bits, and the k-th largest's rank among the keys that share them (0: done)


def fused_top_k_enabled() -> bool:
    """Whether the fused draw (engine/sampler.Sampler) finds top-k's floor here: yes unless TPGRAPH_FUSED_TOP_K=0,
    which keeps torch.topk."""
    return env_flag("TPGRAPH_FUSED_TOP_K", default=True)


if triton is not None:
    _BINS = tl.constexpr(1 << DIGIT_BITS)
    _DIGIT_BITS = tl.constexpr(DIGIT_BITS)
    _STATE_WORDS = tl.constexpr(STATE_WORDS)

    @triton.jit
    def _keys(x, KEY_BITS: tl.constexpr):
        """Unsigned keys (int64) in x's bit width that order as x's values do (-0 just below +0); NaN as 0, below
        -inf's key."""
        if KEY_BITS == 16:
            bits = x.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
        else:
            bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        sign = 1 << (KEY_BITS - 1)
        ones = (1 << KEY_BITS) - 1
        key = tl.where((bits & sign) != 0, bits ^ ones, bits | sign)
        v = x.to(tl.float32)  # (NaN tested in fp32: the interpreter compares 16-bit floats by their bits)
        return tl.where(v == v, key, 0)

    @triton.jit
    def _value(key, x_ptr, KEY_BITS: tl.constexpr):
        """The logit whose key `key` is (as fp32; the NaN key 0 as -inf)."""
        sign = 1 << (KEY_BITS - 1)
        ones = (1 << KEY_BITS) - 1
        bits = tl.where((key & sign) != 0, key ^ sign, key ^ ones)
        if KEY_BITS == 16:
            v = bits.to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        else:
            v = bits.to(tl.int32).to(tl.float32, bitcast=True)
        return tl.where(v == v, v, float("-inf"))

    @triton.jit
    def _select_kernel(x_ptr, stride_x, V, k_ptr, floor_ptr, stride_floor, hist_ptr, state_ptr, counter_ptr, chunks,
                       PASS: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr):
        """Grid (rows, chunks): the chunk's count of the keys that match the row's settled bits, by their next 8 bits,
        into the row's histogram; the row's last chunk settles those bits (and after the last pass writes the
        floor)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        k = tl.load(k_ptr + row).to(tl.int64)
        state = state_ptr + row * _STATE_WORDS
        if PASS == 0:
            todo = k > 0
            if (k <= 0) & (c == 0):
                tl.store(floor_ptr + row * stride_floor, float("-inf"))
        else:
            todo = (k > 0) & (tl.load(state + 1) > 0)
        if todo:
            shift = KEY_BITS - _DIGIT_BITS * (PASS + 1)
            offs = c * CHUNK + tl.arange(0, CHUNK)
            ok = offs < V
            key = _keys(tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0), KEY_BITS)
            if PASS > 0:
                ok = ok & ((key >> (shift + _DIGIT_BITS)) == tl.load(state))
            counts = tl.histogram(((key >> shift) & (_BINS - 1)).to(tl.int32), _BINS, mask=ok).to(tl.int64)
            bins = tl.arange(0, _BINS)
            hist = hist_ptr + row * _BINS + bins
            tl.atomic_add(hist, counts, sem="relaxed")
            if arrived_last(counter_ptr + row, chunks):
                counts = tl.load(hist, cache_modifier=".cg")
                tl.store(hist, tl.zeros_like(counts))  # (for the next pass, or the next call)
                rank = k
                settled = tl.zeros_like(k)
                if PASS > 0:
                    rank = tl.load(state + 1)
                    settled = tl.load(state)
                at_or_above = tl.cumsum(counts, axis=0, reverse=True)
                digit = tl.sum((at_or_above >= rank).to(tl.int32), axis=0) - 1
                if digit < 0:  # fewer keys than k: all kept
                    tl.store(floor_ptr + row * stride_floor, float("-inf"))
                    tl.store(state + 1, 0)
                else:
                    settled = settled * _BINS + digit
                    rank -= tl.sum(tl.where(bins > digit, counts, 0), axis=0)
                    if shift == 0:
                        tl.store(floor_ptr + row * stride_floor, _value(settled, x_ptr, KEY_BITS))
                        tl.store(state + 1, 0)
                    else:
                        tl.store(state, settled)
                        tl.store(state + 1, rank)
                reset_counter(counter_ptr + row)


def top_k_floors(x: torch.Tensor, ks: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
    """x [B, V] logits (fp32/bf16/fp16, a contiguous last dim), ks [B] fp32 per row (k; 0 for none) -> `floors` [B]
    fp32 (may be strided, e.g. a column of kernels/sampling.sample_rows' params), each row's k-th largest logit, -inf
    where k is 0 or at least the row's count of logits. NaN counts below -inf."""
    if triton is None:
        raise RuntimeError("Triton is not installed; find top-k's floor with engine/sampler.top_k_floor")
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"top_k_floors takes [batch, vocab] fp32/bf16/fp16 logits with a contiguous last dim, got "
                         f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}")
    batch, vocab = x.shape
    for name, t in (("ks", ks), ("floors", floors)):
        if t.shape != (batch,) or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"top_k_floors' {name} must be [{batch}] fp32 on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if batch == 0:
        return floors
    if vocab == 0:
        return floors.fill_(float("-inf"))
    ks = aligned(ks)
    key_bits = 8 * x.element_size()
    chunk = max(16, min(CHUNK, triton.next_power_of_2(vocab)))
    chunks = triton.cdiv(vocab, chunk)
    for first in range(0, batch, ROWS_PER_LAUNCH):
        rows = slice(first, first + ROWS_PER_LAUNCH)
        n = min(batch - first, ROWS_PER_LAUNCH)
        # one zeroed allocation: the rows' histograms (each last chunk clears its row's), then their states
        work = torch.zeros(n * ((1 << DIGIT_BITS) + STATE_WORDS), dtype=torch.int64, device=x.device)
        hist, state = work[:n << DIGIT_BITS], work[n << DIGIT_BITS:]
        counters = split_counters(x.device, n)
        for p in range(key_bits // DIGIT_BITS):
            _select_kernel[(n, chunks)](x[rows], x.stride(0), vocab, ks[rows], floors[rows], floors.stride(0), hist,
                                        state, counters, chunks, PASS=p, KEY_BITS=key_bits, CHUNK=chunk, num_warps=4)
    return floors
