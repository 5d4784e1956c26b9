"""Paged decode attention, GQA-grouped and split over the context (flash-decoding).

`paged_decode_attention_v2` computes the same thing as `paged_decode.paged_decode_reference` (its
plain-torch definition and test oracle). It replaced a kernel with one program per (sequence, query head)
that was 10-100x slower on an H200:

- one program per (sequence, KV head, KV split) serves the KV head's whole query group, so each K/V row
  is read once per KV head rather than once per query head, and scores and P @ V are `tl.dot` tiles of
  [group, BLOCK_N] tokens;
- the grid has `num_splits` splits per (sequence, KV head), chosen on the host from the batch size, KV heads, the
  static `max_seq_len` and the SM count, so that a small batch still spreads over the GPU. Each program cuts its
  sequence's actual length (read on the device) into at most that many whole-tile pieces, so a short context on a
  grid sized for a long max_model_len runs a few full splits and the rest of the grid exits at once; a long one is
  cut into fewer, longer pieces than the grid allows (`merge_split_cap`), so that merging them costs less than it
  saves.
  Each split in use leaves a partial (unnormalised acc, running max, sum of exps) in fp32 scratch, which the last one
  to arrive (or a second small kernel) merges: every split's maxima in one load, then the weighted sums several splits
  a load (L2 round trips on the critical path, not bandwidth). With one split the first kernel writes the
  output itself;
- with the L2 prefetch on (`l2_prefetch_tiles_for`), a program also asks L2 for its split's next tiles before that
  wait, and each turn of its loop for one more, so that it stays that many tiles ahead: at 2 stages without the
  read-ahead (an fp32 cache, or forced) the compiled loop loads each later tile into its one shared buffer only once
  the tile before has been used (sm_90a: the next tile's cp.async follows the scores, and the loop's top waits for
  it), so without it every tile pays a whole HBM round trip in turn;
- with a 16-bit cache (`kv_lookahead`, `attention_stages`) the loop reads the next tile's places in the cache a turn
  early, so that the pipeliner keeps a tile's K/V copies in flight (3 stages) while it attends this one, and
  consecutive tiles' round trips overlap;
- as a programmatic dependent, a program loads its first tile of older K/V rows, and the newest row's place in the
  cache, before it waits for the kernel before (only q and the newest row come from it), so the dependent loads
  (length -> block table -> K/V) overlap the qkv kernel's tail, and after the wait one round of loads (q, and the
  newest K and V row as vectors) precedes the first dot.

The launch depends only on shapes and `max_seq_len` (no `.item()`, no host sync), so it can be captured in
a CUDA graph; `seq_lens` is read on the device only.
"""

from __future__ import annotations

import functools

import torch

from tpgraph.kernels._counters import last_split_reduces, partials_buffer, polled_attention, split_counters
from tpgraph.kernels._pdl import pdl_launch, use_pdl
from tpgraph.kernels._rounding import soft_bf16_rounding
from tpgraph.kernels._settings import env_choice, env_flag

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._counters import (
        POLL_LIMIT_C,
        arrived_last,
        is_sentinel,
        poll_exhausted,
        reset_counter,
        sentinel_like,
        unfilled,
    )
    from tpgraph.kernels._pdl import pdl_enter
    from tpgraph.kernels._rounding import to_dtype
except ImportError:  # CPU-only installs without Triton use paged_decode_reference
    triton = None

BLOCK_N = 64  # context tokens per tile
# Split heuristic, tuned on an H200 (bf16, D 128, block 16): about three programs per SM, splits of at least
# one tile, at most 64. Against the best split count found by sweeping, it is within ~10% from 1 to 256
# sequences and 512 to 32K tokens. Three is also what fits: the default launch (4 warps, 3 stages, the read-ahead)
# takes about 135 registers a thread and 72 KB of shared memory, so three programs share an SM; 8 warps or 4 stages
# fit fewer, and at 24-32 sequences the default grid then runs in more than one wave (alone at 32 x 512: 19.6 µs
# with 8 warps, 19.5 with 4 stages, against 14.5).
# Sized for 1 or 2 a SM instead (TPGRAPH_ATTN_PROGRAMS_PER_SM), batches 16-32 took fewer, longer splits: in whole
# TP=1 steps at 512 tokens -0.029 to +0.033 ms, and at 4K tokens +0.028 / +0.106 ms (2) and +0.56 / +0.87 ms (1) at
# batches 16 / 32 (bench/results/2026-12-03_h200_attention_splits).
PROGRAMS_PER_SM = 3
MIN_SPLIT_TOKENS = BLOCK_N
MAX_SPLITS = 64
# Once (sequence, KV head) pairs x TWO_TILE_PAIRS_DIVISOR reach the SM count (batch 4 and up at 4 KV heads on an
# H200's 132 SMs), splits are at least two tiles: one-tile splits of a 512-token context would already fill the GPU,
# and each split pays its partial's store, count and merge. Measured in the whole decode step (bench/results/
# 2026-12-01_h200_solo, run5/run6): 0.030 ms a step faster at batch 8 than one-tile splits, batch 1 (one-tile splits
# kept) and 32 unchanged. Forcing 2 or 4 tiles at every batch won nothing on an H200 (2: -0.005..+0.018 ms a step, 4:
# up to +0.116 ms). 9 rather than 8 (bench/results/2026-12-01_h200_resident, run1): batch 4 then takes two-tile
# splits, 2.658 -> 2.598 ms a step (it had been slower than batch 5); batches 3 and 5 unchanged.
TWO_TILE_PAIRS_DIVISOR = 9
# A long sequence is cut into at most MERGE_SPLITS splits as long as that keeps them within LONG_SPLIT_TILES tiles,
# however many splits the grid has (`_split_span`): the last split's merge walks every split in use, and at batch 1
# and 4K tokens 64 one-tile splits made the merge cost more than the tiles. Measured on an H200 (bench/results/
# 2026-12-01_h200_critical_path, run5, attention alone, µs): 4K tokens 22.3 with 64 splits, 14.4 with 32, 13.2 with 16;
# 32K tokens 41.7 / 43.6 / 66.3, so a 32K context keeps 64 eight-tile splits; and the whole TP=1 step at 4K, batch 1,
# 3.080 -> 2.882 ms. Batch 8 (13 splits of the grid then, 12 since the grid rounds down) was unchanged, as was a
# 512-token context (8 one-tile splits). Those ran with the merge before its maxima came in one load. With it
# (bench/results/2026-12-02_h200_merge_one_load, run1, alone), 128 four-tile splits at 32K tokens lost (28.9 -> 33.4
# µs), and WIDE_MERGE_SPLITS (below) now applies where the grid is small.
MERGE_SPLITS = 16
# Where (sequence, KV head) pairs x WIDE_MERGE_SPLITS programs fit the SMs one each (batch 1 at a TP=2 rank's 4 KV
# heads on an H200), a long sequence takes up to that many splits instead (merge_split_cap): with the merge's maxima in
# one load, more splits of fewer tiles finish sooner while they still fit one wave. Whole TP=1 steps, batch 1, against
# 16 in the same call (bench/results/2026-12-02_h200_merge_one_load, run7c/run8): 4K tokens 2.551 -> 2.517 ms, 8K
# 2.691 -> 2.614; alone 9.6 -> 8.8 µs at 4K, 13.8 -> 11.6 at 8K (run7b). At batch 2 (256 programs) 32 lost: +0.033 ms
# a step at 4K, alone 14.6 -> 16.9 µs. Contexts from 16K tokens take LONG_SPLIT_TILES-tile splits either way, and up
# to 1K one-tile splits.
WIDE_MERGE_SPLITS = 32
LONG_SPLIT_TILES = 8
# How far the loop over a split's later tiles reads ahead (kv_lookahead, the kernel's KV_AHEAD). The compiled loop
# (sm_90a, 2 stages) reads a tile's block-table entries, then its K/V, then waits for both: two dependent round trips
# a tile. Reading the next tile's places a tile early (1) makes it one; holding the next tile's K/V in registers too
# (2) overlaps consecutive tiles, at 226 registers instead of 162 (Triton 3.6, 4 warps, the newest row merged, as at
# batch 1; 204 instead of 111 with it apart), so two programs a SM at most. Timed on an H200
# (bench/results/2026-12-02_h200_kernel_floor, run3-run5), whole TP=1 steps at a TP=2 rank's shape (4 KV heads,
# max_model_len 8192), each against 0 in the same call:
# - 2 at batch 1 (256 programs): -0.002 to -0.010 ms at 512 tokens, -0.050 at 4K; attention alone at 32K tokens
#   42.0 -> 37.8 us. At batches 8 and 32 (384 programs, more than fit two a SM): -0.008 to +0.79 ms, mostly worse,
#   and +0.052 at batch 8 and 512 tokens even though only 128 of its programs have tokens to attend.
# - 1: -0.012 to -0.019 ms at batch 32 and 512 tokens, -0.040 / -0.044 at 4K; at batch 8 +0.045 and +0.067 in the
#   epilogue chain at 512 tokens (-0.010 and -0.004 in the plain one), -0.018 and +0.017 at 4K. Left opt-in then.
# Those ran at 2 stages, where 1 cannot pipeline (see attention_stages). At 3 stages, 1 keeps the next tile's copies in
# flight, and it is now the default with a 16-bit cache (bench/results/2026-12-02_h200_pipelined_tiles), whole TP=1
# steps against the rule before (2 at batch 1 where the grid fits, else 0) in the same call:
# - 512 tokens: -0.012 to +0.019 ms at batches 1-32 (within noise but for +0.019 at batch 2);
# - 4K tokens: -0.034 / 0.000 / -0.127 ms at batches 1 / 8 / 32;
# - 32K tokens (max_model_len 32K+): -0.114 / -0.171 ms at batches 1 / 8.
# 2 and 0 stay opt-in (TPGRAPH_ATTN_KV_AHEAD); an fp32 cache keeps 0 at 2 stages (its 3-stage tiles would take about
# 140 KB of shared memory, untimed).
# The split kernel's warps (attention_warps). 8 (TPGRAPH_ATTN_WARPS=8) won alone at batch 1 and 32K tokens (28.8 ->
# 24.8 µs) but not in whole TP=1 steps, each against 4 in the same call (bench/results/2026-12-02_h200_merge_one_load,
# run4/run5): batch 1 -0.002 / -0.002 / -0.012 ms at 512 / 4K / 32K tokens; batch 2 -0.057 / -0.061 / +0.079; batches
# 3-4 +0.023 to +0.146; batch 8 -0.010 at 512, +0.210 at 4K. The grid is chosen per captured batch, not per context,
# so no rule from these holds at every context.
ATTENTION_WARPS = 4
ATTENTION_STAGES = 2  # the split kernel's pipeline stages without the read-ahead (attention_stages)
PIPELINED_STAGES = 3  # and with it (KV_AHEAD 1)
# From this many sequences decode attention lets o_proj in after its tiles (attention_late_trigger).
LATE_TRIGGER_MIN_BATCH = 2
# From this many sequences the newest row is its own softmax term (newest_apart_for).
NEWEST_APART_MIN_BATCH = 2
# (split, query head) rows of partials the last split's merge loads at once, after one load of every split's maxima
# (_combine_group). That merge used to walk the maxima COMBINE_ROWS at a time too: at batch 1 and 32K tokens (64 splits
# of a 4-head group) 16 dependent L2 round trips, now 9. Attention alone (bench/results/2026-12-02_h200_merge_one_load,
# run1/run6; before: 2026-12-02_h200_pipelined_tiles run1): 1 x 4K 12.7 -> 9.5 µs, 1 x 32K 37.2 or more -> 28.8 (SDPA
# 9.0 and 24.0). Whole TP=1 steps against that kernel in the same call (run2/run3): batch 1 -0.059 / -0.089 / -0.373
# ms at 512 / 4K / 32K tokens, batch 4 at 32K -0.164, batches 8 and 32 within 0.01. 64 rows (16 splits a load at
# groups of 4) was within 0.4 µs of 32 either way alone (run1), not timed in whole steps.
COMBINE_ROWS = 32
# (_combine_group keeps two passes, max then weighted sums: a one-pass merge with a running rescale, one round of
# loads, was slower on an H200, +0.027 / +0.096 ms a step at batch 1 / 8 and context 512, +0.063 ms at batch 8, 4K.)
# The L2 prefetch (opt-in, TPGRAPH_ATTN_L2_PREFETCH=1): how many tiles a program keeps asked of
# L2 ahead of the one it loads next (those after its first before its wait, then one more each turn of its loop), a
# power of two up to MAX_PREFETCH_TILES (a longer split is still covered, a tile a turn), as many as keep the whole
# grid's prefetch within L2_PREFETCH_SHARE of the L2: lines evicted before their tile is loaded would be read from HBM
# twice. Timed on an H200 (bench/results/2026-12-01_h200_wide_default, run1), attention alone: 14.3 ->
# 13.1 µs at batch 1 and 4K tokens (64 programs), but 16.4 -> 18.4 at batch 32 and 512 tokens, 29.9 -> 34.8 at batch
# 8 and 4K, where the grid already streams HBM; whole steps at 512 tokens moved by under 0.005 ms. Left opt-in: a rule
# that prefetches only for grids smaller than the GPU is the candidate, untimed in whole steps at long contexts.
MAX_PREFETCH_TILES = 8
L2_PREFETCH_SHARE = 0.5
CPU_NUM_SMS = 16  # stands in for the SM count off-GPU (the interpreter), so CPU tests see split launches too
_LOG2E = 1.4426950408889634


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms_for(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (a fixed stand-in off CUDA)."""
    if device.type != "cuda":
        return CPU_NUM_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, num_sms: int,
                      min_split_tokens: int = MIN_SPLIT_TOKENS, programs_per_sm: int | None = None) -> int:
    """KV splits per (sequence, KV head) in the grid: as many programs as `programs_per_sm` per SM holds (default
    `attention_programs_per_sm`), at most MAX_SPLITS, and no more than whole tiles of `min_split_tokens` (the tile
    length) in `max_seq_len`. Each program cuts its sequence's actual length into at most that many pieces of whole
    tiles (`_split_span`): the splits a shorter sequence leaves empty exit at once, and the ones in use stay a tile or
    more long (at least `min_split_tiles`; a split's first tile is loaded before the programmatic wait, the rest
    after it)."""
    programs = max(1, batch * kv_heads)
    # Rounded down, so the grid stays within per_sm programs a SM: rounded up, batch 8 at 4K tokens (13 busy splits,
    # 416 programs for 396 places) was 0.095 ms a step slower on an H200 (bench/results/2026-12-01_h200_newest_apart,
    # run3), presumably a second wave for the programs past them.
    per_sm = attention_programs_per_sm() if programs_per_sm is None else programs_per_sm
    if per_sm < 1:
        raise ValueError(f"programs_per_sm must be >= 1, got {per_sm}")
    want = per_sm * num_sms // programs
    return max(1, min(want, max_seq_len // min_split_tokens, MAX_SPLITS))


def min_split_tiles(batch: int, kv_heads: int, num_sms: int) -> int:
    """The fewest tiles (of the launch's block_n tokens) a split takes (`_split_span`): 2 once the (sequence, KV
    head) pairs are many (TWO_TILE_PAIRS_DIVISOR), else 1, so that a small batch spreads a short context over the
    most programs."""
    return 2 if batch * kv_heads * TWO_TILE_PAIRS_DIVISOR >= num_sms else 1


def splits_in_use(num_splits: int, max_seq_len: int, block_n: int = BLOCK_N,
                  long_split_tiles: int = LONG_SPLIT_TILES, *, merge_splits: int) -> int:
    """The most splits of a (sequence, KV head) that `_split_span` puts to work for sequences up to max_seq_len: the
    grid's, no more than one a tile, and no more than `merge_splits` (the launch's: `merge_split_cap` by default, so a
    caller must say which) until those splits would pass `long_split_tiles` tiles."""
    long_split = long_split_tiles * block_n
    return max(1, min(num_splits, -(-max_seq_len // block_n), max(merge_splits, -(-max_seq_len // long_split))))


@functools.cache
def _cuda_l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def l2_prefetch_tiles(programs: int, tile_bytes: int, l2_bytes: int) -> int:
    """The budget rule: the most tiles (0 or a power of two up to MAX_PREFETCH_TILES) that `programs` programs can
    each pull into L2 in `tile_bytes` tiles (K and V) within L2_PREFETCH_SHARE of `l2_bytes`."""
    fit = int(l2_bytes * L2_PREFETCH_SHARE) // max(1, programs * tile_bytes)
    tiles = 0
    while tiles < MAX_PREFETCH_TILES and max(1, 2 * tiles) <= fit:
        tiles = max(1, 2 * tiles)
    return tiles


def l2_prefetch_tiles_for(q: torch.Tensor, kv_heads: int, num_splits: int, max_seq_len: int,
                          block_n: int = BLOCK_N, long_split_tiles: int = LONG_SPLIT_TILES, *,
                          merge_splits: int) -> int:
    """Tiles each program of a launch prefetches into L2 (`l2_prefetch_tiles` over the programs that can be in use):
    0 unless TPGRAPH_ATTN_L2_PREFETCH=1 (opt-in: see L2_PREFETCH_SHARE), and 0 off CUDA (the interpreter has no
    prefetch)."""
    if not env_flag("TPGRAPH_ATTN_L2_PREFETCH", default=False) or q.device.type != "cuda":
        return 0
    programs = q.shape[0] * kv_heads * splits_in_use(num_splits, max_seq_len, block_n, long_split_tiles,
                                                     merge_splits=merge_splits)
    tile_bytes = 2 * block_n * q.shape[-1] * q.element_size()
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return l2_prefetch_tiles(programs, tile_bytes, _cuda_l2_bytes(index))


if triton is not None:

    @triton.jit
    def _split_span(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
                    LONG_TILES: tl.constexpr, MERGE: tl.constexpr):
        """(tokens per split, splits in use) for this sequence's actual length: whole tiles, at least SPLIT_TILES
        of them (min_split_tiles), at most NUM_SPLITS splits (and MERGE up to LONG_TILES-tile splits),
        the last one ending at seq_len. A short context on a grid sized for max_model_len then runs a few full
        splits, and the rest of the grid exits at once (a padded row, seq_len 0, uses one empty split)."""
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        per_split = tl.maximum(per_split, SPLIT_TILES * BLOCK_N)
        # a long sequence: at most MERGE splits while they stay within LONG_TILES tiles, since the last
        # split's merge walks every split in use (decode_attention's MERGE_SPLITS note)
        few = tl.cdiv(tl.cdiv(seq_len, MERGE), BLOCK_N) * BLOCK_N
        per_split = tl.maximum(per_split, tl.minimum(few, LONG_TILES * BLOCK_N))
        return per_split, tl.maximum(tl.cdiv(seq_len, per_split), 1)

    @triton.jit
    def _kv_rows(bt_row, tok, ok, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr):
        """The cache offsets of tokens `tok` (where `ok`): token t lives in cache block block_tables[b, t // BLOCK_SIZE]
        at offset t % BLOCK_SIZE; int64 because block * stride_cb overflows int32 on large caches."""
        block = tl.load(bt_row + tok // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        return block * stride_cb + (tok % BLOCK_SIZE).to(tl.int64) * stride_ct + kv_h * stride_ch

    @triton.jit
    def _load_kv_rows(k_ptr, v_ptr, rows, load, offs_d, d_ok):
        """K and V at cache offsets `rows` where `load` (zeros elsewhere)."""
        kv_mask = load[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _prefetch_kv_l2(k_ptr, v_ptr, bt_row, lo, hi, kv_h, stride_cb, stride_ct, stride_ch,
                        BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, LINE: tl.constexpr,
                        LINES: tl.constexpr):
        """Ask L2 for the K and V rows of tokens lo .. lo + TOKENS that are before hi, LINE elements (a 128-byte line)
        at a time; each prefetch is predicated on its token (tokens past hi ask for nothing). No registers hold the
        data, and L2 is where the kernel before writes the newest row, so a line prefetched before that write is not
        stale."""
        tok = lo + tl.arange(0, TOKENS)
        ok = tok < hi
        rows = _kv_rows(bt_row, tok, ok, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
        offs = rows[:, None] + tl.minimum(tl.arange(0, LINES) * LINE, HEAD_DIM - 1)[None, :]
        want = (ok[:, None] & (offs >= 0)).to(tl.int32)  # (offs >= 0: the mask at the pointers' shape)
        _prefetch_l2(k_ptr + offs, want)
        _prefetch_l2(v_ptr + offs, want)

    @triton.jit
    def _prefetch_l2(ptrs, want):
        """prefetch.global.L2 at each pointer whose `want` is not 0."""
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\t}\n\tmov.u32 $0, 0;",
            "=r,l,r", [ptrs, want], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _attend_tile(q, k, v, tok_ok, m_i, l_i, acc, qk_scale, v_dtype, DOT_PRECISION: tl.constexpr,
                     INTERPRETED: tl.constexpr):
        """One tile of the online softmax: (m, l, acc) updated with the tile's scores and P @ V."""
        if INTERPRETED:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 domain
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        # The tile holds at least one valid token, or (the newest row apart) m_i is already finite from that row:
        # either way m_new is finite and no exp sees inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_lo = to_dtype(p, v_dtype, INTERPRETED)  # P @ V in the cache dtype, as FA does
        if INTERPRETED:
            p_lo = p_lo.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_lo, v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        counter_ptr, qk_scale,
        stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_ob, stride_oh,
        stride_pb, stride_ph, stride_ps,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr,
        DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, LAST_COMBINES: tl.constexpr, PDL: tl.constexpr,
        GROUP_P2: tl.constexpr, COMBINE_CHUNK: tl.constexpr, NEWEST_APART: tl.constexpr,
        PREFETCH_TILES: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr, LATE_TRIGGER: tl.constexpr,
        KV_AHEAD: tl.constexpr, LONG_TILES: tl.constexpr, MERGE: tl.constexpr, SPLITS_P2: tl.constexpr,
        POLLED: tl.constexpr,
    ):
        """LAST_COMBINES (more than one split): no combine kernel. Each split in use counts itself in at
        counter_ptr[b * KV heads + KV head] once its partial is stored, and the one that arrives last merges the
        partials of its whole query group in split order (_combine_group: GROUP_P2 rows; every split's maxima in one
        load of SPLITS_P2 rows, then the weighted sums COMBINE_CHUNK splits a load). LONG_TILES and MERGE: a long
        sequence's splits (_split_span).
        POLLED (with LAST_COMBINES; `polled_attention`): the partials are views of the device's sentinel-filled
        partials buffer, and the last split in use of each (sequence, KV head) merges without a count: it stores its
        own partial too, then polls the splits' partials until none holds the sentinel, merges them in split order as
        _combine_group does, and sets their slots back to the sentinel (_polled_combine_group).

        As a programmatic dependent (PDL), a program loads its first tile of K/V before it waits for the kernel
        before: only q and the newest token's K/V (position seq_len - 1) come from that kernel (qkv + rope + cache
        store). Sequence lengths and block tables were copied in before the step's first kernel, and older cache
        rows by earlier steps; every kernel waits before it lets the next one in, so all but the one before are
        done when a program starts. The next kernel is let in right after the wait, or with LATE_TRIGGER once the
        split's tiles are attended (`attention_late_trigger`).

        KV_AHEAD (`kv_lookahead`): how far the loop over a split's later tiles reads ahead. 0: each tile's block-table
        entries, then its K/V, then its dots, so a tile costs two dependent round trips. 1: the next tile's cache
        places are read while this tile's K/V load, which lets the pipeliner keep the next tile's K/V copies in flight
        at 3 stages (the default with a 16-bit cache). 2: the next tile's K/V too, into registers
        (before the wait with the newest row apart, since older rows do not depend on the kernel before), so the round
        trips of consecutive tiles overlap."""
        b = tl.program_id(0).to(tl.int64)
        kv_h = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        per_split, used = _split_span(seq_len, NUM_SPLITS, BLOCK_N, SPLIT_TILES, LONG_TILES, MERGE)
        if split < used:
            start = split * per_split
            end = tl.minimum(start + per_split, seq_len)
            offs_g = tl.arange(0, GROUP_PAD)
            g_ok = offs_g < GROUP  # rows past the group are padding so that tl.dot gets M >= 16
            heads = kv_h * GROUP + offs_g
            offs_d = tl.arange(0, DIM_PAD)
            d_ok = offs_d < HEAD_DIM
            q_mask = g_ok[:, None] & d_ok[None, :]
            offs_n = tl.arange(0, BLOCK_N)
            bt_row = block_tables_ptr + b * stride_bt

            tok = start + offs_n
            tok_ok = tok < end
            newest = tok == seq_len - 1
            rows = _kv_rows(bt_row, tok, tok_ok, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
            k, v = _load_kv_rows(k_ptr, v_ptr, rows, tok_ok & ~newest, offs_d, d_ok)
            # the newest row's place is read before the wait too (one dependent load after it, not two), and the row
            # comes in as one vector: a second [BLOCK_N, D] tile of K and V would cost registers the kernel lacks
            has_newest = (seq_len - 1 >= start) & (seq_len - 1 < end)
            new_row = _kv_rows(bt_row, seq_len - 1, has_newest, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
            # the tiles the loop leaves to L2's prefetch start after those it loads itself: the first (and, reading
            # ahead into registers, the second)
            if KV_AHEAD == 2:
                lead = 2 * BLOCK_N
            else:
                lead = BLOCK_N
            if PREFETCH_TILES > 0:
                if start + lead < end:  # the split's next tiles: in L2 by the time the loop loads them
                    _prefetch_kv_l2(k_ptr, v_ptr, bt_row, start + lead, end, kv_h, stride_cb, stride_ct, stride_ch,
                                    BLOCK_SIZE, PREFETCH_TILES * BLOCK_N, HEAD_DIM, LINE, LINES)
            # the second tile's tokens end at `stop` too (see below); its cache places are older data
            stop = tl.minimum(end, seq_len - 1) if NEWEST_APART else end
            tok_a = start + BLOCK_N + offs_n
            if KV_AHEAD > 0:
                rows_a = _kv_rows(bt_row, tok_a, tok_a < stop, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
            if KV_AHEAD == 2 and NEWEST_APART:  # older rows only: they do not wait for the kernel before
                k_a, v_a = _load_kv_rows(k_ptr, v_ptr, rows_a, tok_a < stop, offs_d, d_ok)
            pdl_enter(PDL, not LATE_TRIGGER)
            if KV_AHEAD == 2 and not NEWEST_APART:  # the newest row may be in it: after the wait
                k_a, v_a = _load_kv_rows(k_ptr, v_ptr, rows_a, tok_a < stop, offs_d, d_ok)
            new_ok = tl.where(has_newest, d_ok, False)  # (not `&`: the interpreter mistypes scalar & vector)
            new_k = tl.load(k_ptr + new_row + offs_d, mask=new_ok, other=0.0)
            new_v = tl.load(v_ptr + new_row + offs_d, mask=new_ok, other=0.0)
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask,
                        other=0.0)
            if INTERPRETED:
                q = q.to(tl.float32)  # the interpreter holds bf16 as raw uint16 bits, which its tl.dot would multiply
            # the tiles' tokens end at `stop` (set before the wait): with the newest row apart, before it (whichever
            # tile of the split holds it), since it is already in the running sums
            if NEWEST_APART:
                # the newest row as its own score column and P.V term, so that the first tile (loaded before the
                # wait) reaches its dot unchanged; the online softmax starts from it, so a tile that holds only the
                # newest row (all its other columns masked) still sees a finite running max
                s_new = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], axis=1) * qk_scale
                m_i = tl.where(has_newest, s_new, float("-inf"))
                l_i = tl.where(has_newest, 1.0, 0.0) + tl.zeros([GROUP_PAD], tl.float32)
                acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32) + new_v.to(tl.float32)[None, :]
            else:
                k = tl.where(newest[:, None], new_k[None, :], k)
                v = tl.where(newest[:, None], new_v[None, :], v)
                m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                l_i = tl.zeros([GROUP_PAD], tl.float32)
                acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
            if start < end:  # (a padded row's one split is empty)
                m_i, l_i, acc = _attend_tile(q, k, v, tok < stop, m_i, l_i, acc, qk_scale, v_ptr.dtype.element_ty,
                                             DOT_PRECISION, INTERPRETED)
            for tile in range(start + BLOCK_N, end, BLOCK_N):
                if PREFETCH_TILES > 0:  # keep PREFETCH_TILES tiles ahead of the one loaded next
                    ahead = tile + lead - BLOCK_N + PREFETCH_TILES * BLOCK_N
                    if ahead < end:
                        _prefetch_kv_l2(k_ptr, v_ptr, bt_row, ahead, end, kv_h, stride_cb, stride_ct, stride_ch,
                                        BLOCK_SIZE, BLOCK_N, HEAD_DIM, LINE, LINES)
                tok = tile + offs_n
                tok_ok = tok < stop
                if KV_AHEAD == 0:
                    rows = _kv_rows(bt_row, tok, tok_ok, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
                    k, v = _load_kv_rows(k_ptr, v_ptr, rows, tok_ok, offs_d, d_ok)
                else:  # this tile's places (and with 2 its K/V) came a turn early; read the next tile's now
                    if KV_AHEAD == 1:
                        k, v = _load_kv_rows(k_ptr, v_ptr, rows_a, tok_ok, offs_d, d_ok)
                    else:
                        k = k_a
                        v = v_a
                    tok_n = tok + BLOCK_N
                    ok_n = tok_n < stop
                    rows_a = _kv_rows(bt_row, tok_n, ok_n, kv_h, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
                    if KV_AHEAD == 2:
                        k_a, v_a = _load_kv_rows(k_ptr, v_ptr, rows_a, ok_n, offs_d, d_ok)
                m_i, l_i, acc = _attend_tile(q, k, v, tok_ok, m_i, l_i, acc, qk_scale, v_ptr.dtype.element_ty,
                                             DOT_PRECISION, INTERPRETED)
            if PDL and LATE_TRIGGER:  # the K/V reads are done: the next kernel's loads no longer queue before ours
                tl.extra.cuda.gdc_launch_dependents()

            if NUM_SPLITS == 1:
                l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding row): write zeros, not NaN
                out = acc / l_safe[:, None]
                out_offs = b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
                tl.store(out_ptr + out_offs, to_dtype(out, out_ptr.dtype.element_ty, INTERPRETED), mask=q_mask)
            else:
                part = b * stride_pb + heads * stride_ph + split * stride_ps
                tl.store(part_m_ptr + part, m_i, mask=g_ok)
                tl.store(part_l_ptr + part, l_i, mask=g_ok)
                tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
                if POLLED:
                    if split == used - 1:  # the reducer: its partners have lower program ids and never wait
                        tl.debug_barrier()  # its own partial's stores, seen by all of its threads
                        _polled_combine_group(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, b, kv_h, stride_pb,
                                              stride_ph, stride_ps, stride_ob, stride_oh, used, GROUP, GROUP_P2,
                                              HEAD_DIM, DIM_PAD, COMBINE_CHUNK, SPLITS_P2, INTERPRETED)
                elif LAST_COMBINES:
                    counter = counter_ptr + b * tl.num_programs(1) + kv_h
                    if arrived_last(counter, used):
                        _combine_group(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, b, kv_h, stride_pb, stride_ph,
                                       stride_ps, stride_ob, stride_oh, used, GROUP, GROUP_P2, HEAD_DIM, DIM_PAD,
                                       COMBINE_CHUNK, SPLITS_P2, INTERPRETED)
                        reset_counter(counter)

    @triton.jit
    def _combine_group(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, b, kv_h, stride_pb, stride_ph, stride_ps,
                       stride_ob, stride_oh, used, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                       HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr, SPLITS_P2: tl.constexpr,
                       INTERPRETED: tl.constexpr):
        """The query group's output from the partials of its `used` splits (at b * stride_pb + head * stride_ph +
        split * stride_ps), merged in split order: the running max first, then the weighted sums. This runs after the
        last split's count, on the step's critical path, so it costs L2 round trips, not bandwidth: the maxima of
        every split (SPLITS_P2 >= used) come in one load, and the weighted sums walk the splits CHUNK at a time,
        unrolled, so that a chunk's loads are in flight together (a plain loop waited out one round trip a split).
        The same merge as _decode_combine_kernel, summed in sequence where that one sums as a tree: equal within
        rounding, not bit for bit (both fixed, whatever the arrival order, so graph and eager agree either way); the
        chunk size does not change the order of the sums."""
        offs_g = tl.arange(0, GROUP_P2)
        g_ok = offs_g < GROUP
        part0 = b * stride_pb + (kv_h * GROUP + offs_g) * stride_ph
        offs_d = tl.arange(0, DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        offs_s = tl.arange(0, SPLITS_P2)
        m_all = tl.load(part_m_ptr + part0[None, :] + offs_s[:, None] * stride_ps,
                        mask=(offs_s < used)[:, None] & g_ok[None, :], other=float("-inf"), cache_modifier=".cg")
        m_max = tl.max(m_all, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: weights 0, not NaN
        l_total = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, DIM_PAD], tl.float32)
        for c0 in range(0, used, CHUNK):
            for j in tl.static_range(CHUNK):
                part = part0 + (c0 + j) * stride_ps
                ok = tl.where(c0 + j < used, g_ok, False)  # splits past `used`: weight 0, adding zeros
                w = tl.exp2(tl.load(part_m_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_max)
                l_total += tl.load(part_l_ptr + part, mask=ok, other=0.0, cache_modifier=".cg") * w
                acc += tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                               mask=ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg") * w[:, None]
        l_total = tl.where(l_total == 0.0, 1.0, l_total)
        tl.store(out_ptr + b * stride_ob + (kv_h * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :],
                 to_dtype(acc / l_total[:, None], out_ptr.dtype.element_ty, INTERPRETED),
                 mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _polled_combine_group(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, b, kv_h, stride_pb, stride_ph, stride_ps,
                              stride_ob, stride_oh, used, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                              HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr,
                              SPLITS_P2: tl.constexpr, INTERPRETED: tl.constexpr):
        """_combine_group's merge, in the same order and form (its bits), from partials in the sentinel buffer: the
        `used` splits' maxima are polled, past L1, until none holds the sentinel; then each chunk is merged from one
        batch of loads as _combine_group merges it, and kept only if none of what it loaded held the sentinel (a
        partner's stores are not ordered among its threads); else the chunk is polled until none does and merged
        again. So the merge costs the count's round trips less the count's own. (A retry loop around the merge itself
        took 226 registers a thread against the count's 134, sm_90a: fewer programs an SM.) Every slot read goes back
        to the sentinel. The first poll's count is each warp's own or the block's, by the maxima's layout (few splits:
        every warp loads them all); either is safe, since that loop holds no barrier and a slot, written once, is not
        set back before the final barrier (so every warp's m_max is the same). Every count after it is the block's
        (_merge_chunk), so the warps take the retry's barriers together."""
        offs_g = tl.arange(0, GROUP_P2)
        g_ok = offs_g < GROUP
        part0 = b * stride_pb + (kv_h * GROUP + offs_g) * stride_ph
        offs_d = tl.arange(0, DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        rows_ok = g_ok[:, None] & d_ok[None, :]
        offs_s = tl.arange(0, SPLITS_P2)
        ms_ok = (offs_s < used)[:, None] & g_ok[None, :]
        at = part0[None, :] + offs_s[:, None] * stride_ps
        m_all = tl.load(part_m_ptr + at, mask=ms_ok, other=float("-inf"), volatile=True)
        missing = unfilled(is_sentinel(m_all), ms_ok)
        tries = 0
        while (missing > 0) & (tries < POLL_LIMIT_C):
            m_all = tl.load(part_m_ptr + at, mask=ms_ok, other=float("-inf"), volatile=True)
            missing = unfilled(is_sentinel(m_all), ms_ok)
            tries += 1
        poll_exhausted(missing, tries)
        m_max = tl.max(m_all, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: weights 0, not NaN
        l_total = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, DIM_PAD], tl.float32)
        for c0 in range(0, used, CHUNK):
            l_new, acc_new, missing = _merge_chunk(part_acc_ptr, part_m_ptr, part_l_ptr, part0, c0, used, stride_ps,
                                                   m_max, l_total, acc, g_ok, offs_d, d_ok, HEAD_DIM, CHUNK)
            if missing > 0:  # (rare) a row was still on its way: wait for the chunk's rows, then merge it again
                tries = 0
                while (missing > 0) & (tries < POLL_LIMIT_C):
                    _, _, missing = _merge_chunk(part_acc_ptr, part_m_ptr, part_l_ptr, part0, c0, used, stride_ps,
                                                 m_max, l_total, acc, g_ok, offs_d, d_ok, HEAD_DIM, CHUNK)
                    tries += 1
                poll_exhausted(missing, tries)
                l_new, acc_new, missing = _merge_chunk(part_acc_ptr, part_m_ptr, part_l_ptr, part0, c0, used,
                                                       stride_ps, m_max, l_total, acc, g_ok, offs_d, d_ok, HEAD_DIM,
                                                       CHUNK)
                poll_exhausted(missing, POLL_LIMIT_C)  # (a slot gone back to the sentinel: a bug, not a NaN)
            l_total = l_new
            acc = acc_new
        l_total = tl.where(l_total == 0.0, 1.0, l_total)
        tl.store(out_ptr + b * stride_ob + (kv_h * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :],
                 to_dtype(acc / l_total[:, None], out_ptr.dtype.element_ty, INTERPRETED), mask=rows_ok)
        # the slots back to the sentinel, once every warp has made its loads: the merge loaded the maxima and sums in
        # other layouts (other threads) than these stores, and a store must not overtake another warp's load
        tl.debug_barrier()
        tl.store(part_m_ptr + at, sentinel_like(m_all), mask=ms_ok)
        tl.store(part_l_ptr + at, sentinel_like(m_all), mask=ms_ok)
        for s in range(0, used):
            tl.store(part_acc_ptr + (part0 + s * stride_ps)[:, None] * HEAD_DIM + offs_d[None, :],
                     sentinel_like(acc), mask=rows_ok)

    @triton.jit
    def _merge_chunk(part_acc_ptr, part_m_ptr, part_l_ptr, part0, c0, used, stride_ps, m_max, l_total, acc, g_ok,
                     offs_d, d_ok, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
        """(l_total, acc) with splits c0 .. c0 + CHUNK - 1 (those below `used`) added in order as _combine_group adds
        them, from volatile loads issued together, and a count that is nonzero when any loaded value held the sentinel
        (the result is then not to be kept): of the acc rows' elements, each flagged by its own value, its row's
        maximum and its row's sum."""
        stale = tl.zeros(acc.shape, tl.int1)
        for j in tl.static_range(CHUNK):
            part = part0 + (c0 + j) * stride_ps
            ok = tl.where(c0 + j < used, g_ok, False)
            m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"), volatile=True)
            sums = tl.load(part_l_ptr + part, mask=ok, other=0.0, volatile=True)
            row = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                          other=0.0, volatile=True)
            # the maxima and sums are loaded by every warp (replicated): counted apart, a warp that read one a moment
            # before its partner stored it disagreed with the others and went alone into the retry's block barriers
            # (hung reducers). Flagged on the acc rows' elements, they join the rows' one block-wide count. (Triton
            # may merge a second load of them, in l_total's layout, issued after the flagged one: unchecked itself.)
            stale = stale | is_sentinel(row) | (is_sentinel(m) | is_sentinel(sums))[:, None]
            w = tl.exp2(m - m_max)
            l_total += sums * w
            acc += row * w[:, None]
        return l_total, acc, unfilled(stale, g_ok[:, None] & d_ok[None, :])  # one block-wide reduction: warps agree

    @triton.jit
    def _decode_combine_kernel(
        part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, seq_lens_ptr,
        stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr,
        LONG_TILES: tl.constexpr, MERGE: tl.constexpr,
    ):
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        _, used = _split_span(tl.load(seq_lens_ptr + b), NUM_SPLITS, BLOCK_N, SPLIT_TILES, LONG_TILES, MERGE)
        offs_s = tl.arange(0, SPLITS_PAD)
        s_ok = offs_s < used  # the splits past them wrote nothing
        part = b * stride_pb + h * stride_ph + offs_s * stride_ps
        m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
        l_part = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: weights 0, not NaN
        w = tl.exp2(m - m_max)
        l_total = tl.sum(l_part * w, axis=0)
        l_total = tl.where(l_total == 0.0, 1.0, l_total)
        offs_d = tl.arange(0, DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                      other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / l_total
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, to_dtype(out, out_ptr.dtype.element_ty, INTERPRETED),
                 mask=d_ok)


def newest_apart_for(batch: int) -> bool:
    """Whether the newest row, which the kernel before has just written, enters the online softmax as its own score
    column and P.V term (NEWEST_APART) instead of being merged into the first K/V tile after the PDL wait; the tile
    loaded before the wait then reaches its dot unchanged (sm_90a: 163 instructions between the wait and the first
    mma instead of 442, 128 registers instead of 156). TPGRAPH_ATTN_NEWEST_APART=1 / 0 forces it; unset, from
    NEWEST_APART_MIN_BATCH sequences up. Whole TP=1 steps on one H200 (bench/results/2026-12-01_h200_newest_apart,
    run3, context 512): 0.052-0.070 ms faster at batches 2, 4 and 8, and 0.010 ms slower at batch 1."""
    return env_flag("TPGRAPH_ATTN_NEWEST_APART", default=batch >= NEWEST_APART_MIN_BATCH)


def attention_late_trigger(batch: int) -> bool:
    """Whether decode attention lets the next kernel in once a split's tiles are attended (before its partials are
    stored and merged), not right after its PDL wait. The next kernel is o_proj, whose one-row
    resident tiles load 16 MB of weights as soon as they are in (gemv.resident), and attention's loads after the wait
    (q, the newest row, later tiles) then queue behind them: at batch 1 attention added 8.4-9.2 us a layer beside
    them against 6.1 before (bench/results/2026-12-01_h200_resident). On from LATE_TRIGGER_MIN_BATCH sequences
    (TPGRAPH_ATTN_LATE_TRIGGER=0/1 forces it). Whole TP=1 steps, 512 tokens, against it off in the same call
    (bench/results/2026-12-02_h200_kernel_floor run1, 2026-12-02_h200_pipelined_tiles): batch 1 +0.021 / +0.025 ms,
    2 -0.003, 4 0.000, 8 -0.023 / -0.036, 16 -0.027, 32 +0.005 / -0.002: at batch 1 o_proj's resident tiles need
    attention's whole time to load, and from batch 8 o_proj streams after its wait."""
    return env_flag("TPGRAPH_ATTN_LATE_TRIGGER", default=batch >= LATE_TRIGGER_MIN_BATCH)


def kv_lookahead(dtype: torch.dtype) -> int:
    """How far decode attention's loop over a split's later tiles reads ahead (the kernel's KV_AHEAD) with a cache of
    `dtype`: the next tile's places (1, pipelined at PIPELINED_STAGES) for 16 bits, else not at all (0); see the note
    above ATTENTION_STAGES for the timings. TPGRAPH_ATTN_KV_AHEAD=0/1/2 forces it (2: the next tile's K/V in
    registers, which beat 0 at 2 stages at batch 1 and lost to 1 at 3 stages: 2026-12-02_h200_pipelined_tiles run5).
    Every batch and grid takes the same: batch 1 and batch 8 were timed alike."""
    return env_choice("TPGRAPH_ATTN_KV_AHEAD", (0, 1, 2), 1 if dtype.itemsize == 2 else 0)


def attention_stages(kv_ahead: int) -> int:
    """The split kernel's software-pipeline stages for a tile loop that reads `kv_ahead` ahead: PIPELINED_STAGES for
    1, else ATTENTION_STAGES; TPGRAPH_ATTN_STAGES=2/3/4 forces them. More than 2 only pipelines the tile loop when it
    reads the next tile's places ahead (KV_AHEAD 1): Triton's pipeliner leaves a loop whose K/V addresses come from a
    load in the same turn (the block table) unpipelined at any stage count; with them carried from the turn before, 3
    stages keep a tile's K/V copies in flight (sm_90a, Triton 3.6 and 3.9: wait_group 2, 70 KB of shared memory; 117
    registers with the newest row apart, 168 merged, on 3.6) and 4 stages two. Forced settings are taken as given:
    TPGRAPH_ATTN_STAGES=2 with the read-ahead 1 is the unpipelined loop that lost at batch 8, and
    TPGRAPH_ATTN_KV_AHEAD=1 with an fp32 cache takes 3 stages of fp32 tiles (about 140 KB of shared memory, untimed)."""
    return env_choice("TPGRAPH_ATTN_STAGES", (2, 3, 4), PIPELINED_STAGES if kv_ahead == 1 else ATTENTION_STAGES)


def merge_split_cap(batch: int, kv_heads: int, num_sms: int) -> int:
    """How many splits a long sequence takes at most until they would pass LONG_SPLIT_TILES tiles: WIDE_MERGE_SPLITS
    where batch x kv_heads x that many programs fit num_sms, else MERGE_SPLITS; TPGRAPH_ATTN_MERGE_SPLITS=8/16/32/64
    forces it."""
    wide = batch * kv_heads * WIDE_MERGE_SPLITS <= num_sms
    return env_choice("TPGRAPH_ATTN_MERGE_SPLITS", (8, 16, 32, 64), WIDE_MERGE_SPLITS if wide else MERGE_SPLITS)


def attention_programs_per_sm() -> int:
    """Programs a SM the split grid is sized for (choose_num_splits): PROGRAMS_PER_SM; TPGRAPH_ATTN_PROGRAMS_PER_SM=
    1/2/3/4 forces it, for timing fewer, longer splits where the batch's (sequence, KV head) pairs alone come near the
    SM count."""
    return env_choice("TPGRAPH_ATTN_PROGRAMS_PER_SM", (1, 2, 3, 4), PROGRAMS_PER_SM)


def attention_warps() -> int:
    """The split kernel's warps: ATTENTION_WARPS; TPGRAPH_ATTN_WARPS=4/8 forces them."""
    return env_choice("TPGRAPH_ATTN_WARPS", (4, 8), ATTENTION_WARPS)


def combine_tiles(group: int, splits: int, combine_rows: int = COMBINE_ROWS) -> dict:
    """The last split's merge (_combine_group): the query group to a power of two, `splits` (the grid's) to one for
    the one load of every split's maxima, and combine_rows // the group's power of two splits' partials a load (32
    rows: 32 fp32 registers a thread for 128-dim heads at 4 warps)."""
    group_p2 = triton.next_power_of_2(group)
    return dict(GROUP_P2=group_p2, COMBINE_CHUNK=max(1, combine_rows // group_p2),
                SPLITS_P2=triton.next_power_of_2(splits))


def paged_decode_attention_v2(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                              max_seq_len: int, num_splits: int | None = None,
                              split_tiles: int | None = None, newest_apart: bool | None = None,
                              block_n: int = BLOCK_N, num_warps: int | None = None, num_stages: int | None = None,
                              l2_prefetch: int | None = None, kv_ahead: int | None = None,
                              long_split_tiles: int | None = None, merge_splits: int | None = None,
                              combine_rows: int | None = None) -> torch.Tensor:
    """Same arguments and result as `paged_decode_reference`: q [B, Hq, D]; caches [blocks, block_size, Hkv, D];
    block_tables [B, M] int32; seq_lens [B] int32 -> [B, Hq, D]; a seq_len 0 row yields zeros.

    max_seq_len: the static bound on seq_lens that sizes the split grid (each program splits its sequence's actual
    length, so a longer sequence is still whole, in longer splits). num_splits overrides `choose_num_splits`,
    split_tiles `min_split_tiles`. newest_apart (default: `newest_apart_for(batch)`): the newest row enters the
    online softmax as its own score column and P.V term rather than merged into the first tile (see that setting).
    block_n (tokens per tile, a power of two from 16), num_warps and num_stages: the launch's shape, for sweeping
    them (bench/bench_attention_sweep.py); the defaults are what the model runs (`attention_warps`,
    `attention_stages`).
    l2_prefetch: how many tiles each program keeps asked of L2 ahead of the one it loads next, 0 or a power of two
    (default: `l2_prefetch_tiles_for`, off unless TPGRAPH_ATTN_L2_PREFETCH=1); under the interpreter it is not done
    (a prefetch changes no result, and the interpreter runs no inline assembly). kv_ahead: how far the tile loop
    reads ahead, 0, 1 or 2 (default: `kv_lookahead`); each attends the same tiles in the same order (the same bits
    under the interpreter). merge_splits and long_split_tiles: a long sequence takes at most merge_splits splits
    (default `merge_split_cap`, by the batch and the SM count) until they would pass long_split_tiles tiles (default
    LONG_SPLIT_TILES; see `splits_in_use`); combine_rows: how many (split, query head) rows of partials the last
    split's merge loads at once (default COMBINE_ROWS). The defaults are the model's; other values are for sweeping.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; use paged_decode_reference or install triton")
    batch, num_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % kv_heads or k_cache.shape[3] != dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("K and V caches must share a layout with a contiguous head_dim")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError("q and the caches must share a dtype")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two from 16 (tl.dot's smallest side), got {block_n}")
    long_split_tiles = LONG_SPLIT_TILES if long_split_tiles is None else long_split_tiles
    combine_rows = COMBINE_ROWS if combine_rows is None else combine_rows
    num_sms = num_sms_for(q.device)
    merge_splits = merge_split_cap(batch, kv_heads, num_sms) if merge_splits is None else merge_splits
    if min(long_split_tiles, combine_rows, merge_splits) < 1:
        raise ValueError(f"long_split_tiles, merge_splits and combine_rows must be >= 1, got {long_split_tiles}, "
                         f"{merge_splits}, {combine_rows}")
    if kv_ahead is not None and kv_ahead not in (0, 1, 2):
        raise ValueError(f"kv_ahead must be 0, 1 or 2, got {kv_ahead}")
    if l2_prefetch is not None and (l2_prefetch < 0 or l2_prefetch & (l2_prefetch - 1)
                                    or l2_prefetch > MAX_PREFETCH_TILES):
        raise ValueError(f"l2_prefetch must be 0 or a power of two up to {MAX_PREFETCH_TILES} (tiles), "
                         f"got {l2_prefetch}")
    group = num_heads // kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_seq_len, num_sms, min_split_tokens=block_n)
    num_splits = max(1, int(num_splits))
    if kv_ahead is None:
        kv_ahead = kv_lookahead(q.dtype)
    num_stages = attention_stages(kv_ahead) if num_stages is None else num_stages
    num_warps = attention_warps() if num_warps is None else num_warps
    split_tiles = max(1, int(min_split_tiles(batch, kv_heads, num_sms) if split_tiles is None else split_tiles))
    out = torch.empty_like(q)
    if batch == 0:
        return out
    # the kernel indexes seq_lens and a block-table row by unit steps (a no-op for the engine's contiguous buffers);
    # a copy made here is a kernel the early reads below must not run ahead of: no PDL then
    copied = not seq_lens.is_contiguous() or block_tables.stride(-1) != 1
    seq_lens = seq_lens.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    interpreted = soft_bf16_rounding(q)
    dim_pad = triton.next_power_of_2(dim)
    last_combines = num_splits > 1 and last_split_reduces()
    rows = batch * num_heads * num_splits  # (split, query head) rows of partials
    partials = partials_buffer(q.device, rows * (dim + 2)) if last_combines and polled_attention() else None
    if partials is not None:  # views of the sentinel-filled buffer: acc rows, then the maxima, then the sums
        part_acc = partials[:rows * dim].view(batch, num_heads, num_splits, dim)
        part_m = partials[rows * dim:rows * (dim + 1)].view(batch, num_heads, num_splits)
        part_l = partials[rows * (dim + 1):rows * (dim + 2)].view(batch, num_heads, num_splits)
    elif num_splits > 1:
        part_acc = torch.empty((batch, num_heads, num_splits, dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # placeholders, not touched when NUM_SPLITS == 1
        part_acc = part_m = part_l = out
    part_strides = (num_heads * num_splits, num_splits, 1)  # of part_m / part_l; part_acc adds * HEAD_DIM
    if l2_prefetch is None:
        l2_prefetch = l2_prefetch_tiles_for(q, kv_heads, num_splits, max_seq_len, block_n, long_split_tiles,
                                            merge_splits=merge_splits)
    line = max(1, 128 // q.element_size())  # elements in a 128-byte L2 line
    counters = split_counters(q.device, batch * kv_heads) if last_combines and partials is None else out
    pdl = use_pdl(q) and not copied
    merge_tiles = combine_tiles(group, num_splits, combine_rows)  # (SPLITS_P2 sizes the combine kernel's load as well)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *part_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, HEAD_DIM=dim,
        DIM_PAD=dim_pad, BLOCK_N=block_n, NUM_SPLITS=num_splits, SPLIT_TILES=split_tiles,
        # fp32 inputs: full-precision dot (tf32 would lose ~3 digits); 16-bit inputs ignore the setting.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=interpreted, LAST_COMBINES=last_combines, PDL=pdl,
        **merge_tiles, LONG_TILES=long_split_tiles, MERGE=merge_splits,
        NEWEST_APART=newest_apart_for(batch) if newest_apart is None else bool(newest_apart),
        PREFETCH_TILES=0 if interpreted else l2_prefetch, LINE=line,  # (the interpreter has no inline asm)
        LINES=triton.next_power_of_2(-(-dim // line)), LATE_TRIGGER=attention_late_trigger(batch) and pdl,
        KV_AHEAD=kv_ahead, POLLED=partials is not None,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True, **pdl_launch(pdl),
    )
    if num_splits > 1 and not last_combines:
        _decode_combine_kernel[(batch, num_heads)](
            part_acc, part_m, part_l, out, seq_lens, *part_strides, out.stride(0), out.stride(1),
            HEAD_DIM=dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=merge_tiles["SPLITS_P2"],
            BLOCK_N=block_n, SPLIT_TILES=split_tiles, INTERPRETED=interpreted, PDL=pdl, LONG_TILES=long_split_tiles,
            MERGE=merge_splits, num_warps=4,
            enable_fp_fusion=True, **pdl_launch(pdl),
        )
    return out
