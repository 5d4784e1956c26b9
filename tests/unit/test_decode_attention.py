"""The split-KV, GQA-grouped Triton decode kernel (run by Triton's interpreter on CPU) against the torch
reference `paged_decode_reference`."""

import os
import re

import pytest
import torch
from tpgtest.paged_cases import random_paged_case
from tpgtest.polled import arrive_late, spy_partials
from tpgtest.ptx import assert_semaphore_order, branch_sources, sm90_ptx, sm90_ptx_and_usage

from tpgraph.errors import ConfigError
from tpgraph.kernels import decode_attention
from tpgraph.kernels.decode_attention import (
    BLOCK_N,
    CPU_NUM_SMS,
    MAX_PREFETCH_TILES,
    MERGE_SPLITS,
    MIN_SPLIT_TOKENS,
    attention_stages,
    choose_num_splits,
    kv_lookahead,
    l2_prefetch_tiles,
    l2_prefetch_tiles_for,
    min_split_tiles,
    newest_apart_for,
    paged_decode_attention_v2,
    splits_in_use,
)
from tpgraph.kernels.paged_decode import paged_decode_reference

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
# CPU tensors: only Triton's interpreter runs them (conftest turns it on when there is no GPU).
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")

# Seeds whose layouts cover group sizes 1/4/8, head_dim 64/80/128 and block sizes 4/8/16, with padded rows
# (checked by test_seeds_cover_the_layouts).
SEEDS = [0, 4, 6, 10, 17, 22, 31, 36]


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_seeds_cover_the_layouts():
    seen = set()
    for seed in SEEDS:
        q, k, _, _, lens, _ = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=70)
        seen |= {("group", q.shape[1] // k.shape[2]), ("dim", k.shape[3]), ("block", k.shape[1])}
        seen |= {("padded row",)} if (lens == 0).any() else set()
    assert seen >= {("group", 1), ("group", 4), ("group", 8), ("dim", 64), ("dim", 80), ("dim", 128),
                    ("block", 4), ("block", 8), ("block", 16), ("padded row",)}


@pytest.mark.parametrize("split_tiles", [1, 2])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("seed", SEEDS)
def test_matches_reference(seed, num_splits, split_tiles):
    """max_seq_len 70 is one split by the heuristic; with 3 forced splits of one tile or more, a sequence of up to 64
    tokens uses one and a longer one two (the third program exits); with two tiles or more, one."""
    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=70)
    if num_splits is None:
        assert choose_num_splits(q.shape[0], k.shape[2], 70, CPU_NUM_SMS) == 1
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=70, num_splits=num_splits,
                                    split_tiles=split_tiles)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


@pytest.mark.parametrize("newest_apart", [False, True])
@pytest.mark.parametrize(("block_n", "num_splits"), [(16, 5), (32, None), (128, 2), (128, None)])
@pytest.mark.parametrize("seed", [0, 10, 22])
def test_other_tile_lengths_and_launch_shapes_match_the_reference(seed, block_n, num_splits, newest_apart):
    """The launch shapes bench/bench_attention_sweep.py tries: tiles of 16 to 128 tokens (the grid's split count
    then follows the tile: choose_num_splits' min_split_tokens), 8 warps, 3 stages, the newest row apart or not."""
    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=300)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=300, num_splits=num_splits,
                                    newest_apart=newest_apart, block_n=block_n, num_warps=8, num_stages=3)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


def test_a_tile_length_that_is_not_a_power_of_two_from_16_is_refused():
    q, k, v, bt, lens, scale = random_paged_case(0, "cpu", torch.float32, max_batch=2, max_len=70)
    for bad in (8, 48, 0):
        with pytest.raises(ValueError, match="block_n must be a power of two from 16"):
            paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=70, block_n=bad)


@pytest.mark.parametrize("seed", [0, 10, 22])
def test_heuristic_splits_long_contexts(seed):
    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=600)
    assert choose_num_splits(q.shape[0], k.shape[2], 600, CPU_NUM_SMS) > 1
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=600)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


def test_choose_num_splits(monkeypatch):
    monkeypatch.delenv("TPGRAPH_ATTN_PROGRAMS_PER_SM", raising=False)  # (the model's rule, whatever the shell sets)
    assert choose_num_splits(64, 8, 4096, 132) == 1  # enough programs already
    assert choose_num_splits(1, 8, 100, 132) == 1  # too short to be worth splitting
    splits = choose_num_splits(1, 1, 32768, 132)
    assert 1 < splits <= 64
    assert choose_num_splits(1, 1, 512, 132) == 512 // MIN_SPLIT_TOKENS  # none shorter than MIN_SPLIT_TOKENS
    # a TP=2 rank of Llama-3-8B (4 KV heads) at batch 8, graphs for ~600 tokens: 9 splits in the grid; a 512-token
    # context runs 4 of them, two tiles each (min_split_tiles), and the grid's spare splits exit
    assert choose_num_splits(8, 4, 600, 132) == 9 > 512 // BLOCK_N
    assert choose_num_splits(1, 4, 8192, 132) == 64  # a long max_model_len: the cap
    assert choose_num_splits(8, 4, 4096, 132) == 12  # 396 // 32: rounded down, the grid fits 3 programs an SM
    assert choose_num_splits(1, 4, 512, 132, min_split_tokens=128) == 4  # longer tiles: fewer splits fit


def test_the_split_grid_follows_the_programs_an_sm_it_is_sized_for(monkeypatch):
    """Batch 32 of a TP=2 Llama-3-8B rank (128 sequence x KV head pairs on 132 SMs): 3 splits at the default, 1 or 2
    when the grid is sized for fewer programs a SM, by argument (before the environment) or by
    TPGRAPH_ATTN_PROGRAMS_PER_SM; bad values are refused by name."""
    monkeypatch.delenv("TPGRAPH_ATTN_PROGRAMS_PER_SM", raising=False)
    assert choose_num_splits(32, 4, 8192, 132) == 3
    assert choose_num_splits(32, 4, 8192, 132, programs_per_sm=1) == 1
    with pytest.raises(ValueError, match="programs_per_sm"):
        choose_num_splits(32, 4, 8192, 132, programs_per_sm=0)
    monkeypatch.setenv("TPGRAPH_ATTN_PROGRAMS_PER_SM", "2")
    assert choose_num_splits(32, 4, 8192, 132) == 2 and choose_num_splits(16, 4, 8192, 132) == 4
    assert choose_num_splits(32, 4, 8192, 132, programs_per_sm=3) == 3
    monkeypatch.setenv("TPGRAPH_ATTN_PROGRAMS_PER_SM", "5")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_PROGRAMS_PER_SM"):
        choose_num_splits(32, 4, 8192, 132)


def test_splits_take_two_tiles_once_sequence_kv_head_pairs_are_many():
    """Batch 1 to 3 of a TP=2 Llama-3-8B rank (4 KV heads) on 132 SMs keep one-tile splits; batch 4 and more
    take two."""
    assert [min_split_tiles(b, 4, 132) for b in (1, 3, 4, 5, 8, 32)] == [1, 1, 2, 2, 2, 2]
    assert min_split_tiles(1, 8, 132) == 1 and min_split_tiles(2, 8, 132) == 2  # 8 KV heads: 16 pairs


@pytest.mark.parametrize("split_tiles", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_rows_give_zeros_not_nan(num_splits, split_tiles):
    q, k, v, bt, lens, scale = random_paged_case(6, "cpu", torch.float32)
    lens[0] = 0
    lens[-1] = 0
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=70, num_splits=num_splits,
                                    split_tiles=split_tiles)
    assert torch.all(out[0] == 0) and torch.all(out[-1] == 0) and not torch.isnan(out).any()
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_strided_seq_lens_and_block_tables_match_the_reference(num_splits):
    """Views with non-unit steps (every other element of wider tensors): read as the reference reads them, not as if
    their elements were adjacent."""
    q, k, v, bt, lens, scale = random_paged_case(17, "cpu", torch.float32, max_batch=3, max_len=200)
    strided_lens = torch.stack([lens, torch.zeros_like(lens)], dim=1)[:, 0]
    strided_bt = torch.stack([bt, torch.zeros_like(bt)], dim=2)[:, :, 0]
    assert strided_lens.stride(0) != 1 and strided_bt.stride(1) != 1
    out = paged_decode_attention_v2(q, k, v, strided_bt, strided_lens, scale, max_seq_len=200, num_splits=num_splits)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


def test_context_longer_than_max_seq_len_is_still_whole():
    """max_seq_len only sizes the grid: splits follow seq_len, so they just get longer."""
    q, k, v, bt, lens, scale = random_paged_case(17, "cpu", torch.float32, max_batch=3, max_len=200)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=64, num_splits=2)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


def test_bf16_within_bf16_tolerance():
    """16-bit caches take the P @ V product in bf16 (as flash attention does); a bf16-sized tolerance."""
    q, k, v, bt, lens, scale = random_paged_case(22, "cpu", torch.bfloat16, max_batch=3, max_len=150)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=150, num_splits=2)
    ref = paged_decode_reference(q, k, v, bt, lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("split_tiles", [1, 2])
@pytest.mark.parametrize("seed", [0, 6, 17, 31])
@pytest.mark.parametrize("num_splits", [2, 3, 4])
def test_the_last_split_combines_like_the_combine_kernel(monkeypatch, seed, num_splits, split_tiles):
    """Last-split reductions (the default): the last split of each (sequence, KV head) merges the group's partials (no
    combine kernel). It matches the reference and the combine kernel, repeats bit for bit, padded rows give zeros,
    and the counters are back at zero after every call."""
    from tpgraph.kernels._counters import split_counters

    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=200)
    lens[-1] = 0  # a padded row: every split empty
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")  # the combine kernel first
    run = dict(max_seq_len=200, num_splits=num_splits, split_tiles=split_tiles)
    kernel = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    first = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    _check(first, paged_decode_reference(q, k, v, bt, lens, scale))
    torch.testing.assert_close(first, kernel, atol=1e-6, rtol=1e-6)
    assert torch.all(first[-1] == 0)
    assert not split_counters(q.device, q.shape[0] * k.shape[2]).any()
    again = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    assert torch.equal(again, first)


@pytest.mark.parametrize("seed", [6, 17, 23])  # query groups of 4, 8, 4: 8, 4, 8 splits a load
@pytest.mark.parametrize("num_splits", [13, 22])  # grids of 13 and 22 splits, 12 of them in use
def test_the_last_split_merges_more_splits_than_one_load_of_sums_takes(monkeypatch, seed, num_splits):
    """Long contexts: more splits in use than COMBINE_CHUNK (the weighted sums' unrolled loads), a partial last chunk at
    groups of 4, whole chunks at 8; the reference, the combine kernel within rounding, the same bits on a second
    call."""
    from tpgraph.kernels.decode_attention import combine_tiles

    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=2, max_len=1500)
    lens[0] = 1500  # MERGE_SPLITS: splits of 2 tiles (1500 / 16 tokens, rounded up to tiles), 12 of them in use
    chunk = combine_tiles(q.shape[1] // k.shape[2], num_splits)["COMBINE_CHUNK"]
    assert 12 > chunk
    run = dict(max_seq_len=1500, num_splits=num_splits, split_tiles=1)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")
    kernel = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    first = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    _check(first, paged_decode_reference(q, k, v, bt, lens, scale))
    torch.testing.assert_close(first, kernel, atol=1e-6, rtol=1e-6)
    assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, **run), first)


@pytest.mark.parametrize(("seed", "num_splits", "split_tiles", "max_len"),  # groups of 1, 4, 8 and 4; 3 rows each
                         [(0, 2, 1, 200), (6, 4, 2, 200), (10, 3, 1, 200), (22, 22, 1, 1500)])
def test_the_polled_merge_gives_the_counted_bits_and_rearms_its_slots(monkeypatch, seed, num_splits, split_tiles,
                                                                      max_len):
    """TPGRAPH_POLLED_ATTENTION=1: the last split in use polls the splits' partials in the sentinel buffer instead of
    arriving last by a count, and merges them as the count's merge does: its bits (a padded row, one-split sequences
    and, at 1500 tokens, 12 splits in use, more than a chunk), twice over, every slot back at the sentinel, no
    counter touched, and the buffer really taken."""
    from tpgraph.kernels import _counters

    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=max_len)
    assert q.shape[0] == 3
    lens[-1] = 0  # a padded row: its one split merges nothing
    lens[0] = max_len
    run = dict(max_seq_len=max_len, num_splits=num_splits, split_tiles=split_tiles)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    counted = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    monkeypatch.setenv("TPGRAPH_POLLED_ATTENTION", "1")
    taken = spy_partials(monkeypatch, "decode_attention")
    for _ in range(2):
        assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, **run), counted)
        assert (_counters.partials_buffer(q.device, 1).view(torch.int32) == _counters.PARTIAL_SENTINEL).all()
        assert not _counters.split_counters(q.device, q.shape[0] * k.shape[2]).any()
    assert taken == [q.shape[0] * q.shape[1] * num_splits * (q.shape[2] + 2)] * 2
    monkeypatch.setattr(_counters, "PARTIAL_WORDS", 10)  # too small: the count again, the same bits
    assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, **run), counted)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the discarded merge's NaN products
@pytest.mark.parametrize(("which", "split", "late"), [("acc", 1, 2), ("acc", 9, 1), ("l", 3, 3), ("acc", 11, 1),
                                                      ("acc", 1, None)])
def test_the_polled_merge_waits_for_a_late_partial(monkeypatch, which, split, late):
    """A partner's value (an acc element, or a sum) still on its way when the reducer first loads it (the
    interpreter runs programs in order, so this makes it so: the first `late` volatile loads of that slot see the
    sentinel): the chunk is polled and merged again, and the result is the count's bits with every slot re-armed
    (chunk 0, chunk 1, the reducer's own slot); a value that never arrives raises (on a GPU, the trap) rather than
    giving NaN or hanging."""
    from tpgraph.kernels import _counters

    q, k, v, bt, lens, scale = random_paged_case(22, "cpu", torch.float32, max_batch=3, max_len=1500)
    lens[-1], lens[0] = 0, 1500  # the first row: 12 splits in use, chunks of 8 (a query group of 4)
    run = dict(max_seq_len=1500, num_splits=22, split_tiles=1)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    counted = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    monkeypatch.setenv("TPGRAPH_POLLED_ATTENTION", "1")
    batch, heads, dim = q.shape
    rows = batch * heads * 22
    buf = _counters.partials_buffer(q.device, rows * (dim + 2))
    row = 1 * 22 + split  # sequence 0, query head 1, the split's row
    slot = buf.data_ptr() + 4 * (row * dim + 5 if which == "acc" else rows * (dim + 1) + row)
    seen = arrive_late(monkeypatch, slot, late)
    if late is None:
        from triton.runtime.errors import InterpreterError

        with pytest.raises(InterpreterError, match="inline_asm"):  # the trap's asm, which the interpreter refuses
            paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
        buf.view(torch.int32).fill_(_counters.PARTIAL_SENTINEL)  # (the failed merge re-armed nothing)
        return
    assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, **run), counted)
    assert len(seen) > late  # the slot was loaded again after it arrived
    assert (buf.view(torch.int32) == _counters.PARTIAL_SENTINEL).all()


@pytest.mark.parametrize("combine_rows", [4, 8, 64])  # a query group of 4: 1, 2 and 16 splits a load (12 in use)
def test_the_merge_chunk_does_not_change_the_bits(monkeypatch, combine_rows):
    """The last split's merge sums the splits in order however many it loads at once (combine_rows): the same bits
    as the default's, over 12 splits in use."""
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")  # the merge in the last split, not the combine kernel
    q, k, v, bt, lens, scale = random_paged_case(23, "cpu", torch.float32, max_batch=2, max_len=1500)
    assert q.shape[1] // k.shape[2] == 4
    lens[0] = 1500
    run = dict(max_seq_len=1500, num_splits=22, split_tiles=1)
    default = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run)
    assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, combine_rows=combine_rows, **run),
                       default)


@pytest.mark.parametrize("long_split_tiles", [1, 2, 3])
def test_shorter_long_splits_put_more_splits_to_work(long_split_tiles):
    """long_split_tiles caps how long a long sequence's splits grow: at 1500 tokens in 16-token tiles the default (8)
    leaves MERGE_SPLITS (16) six-tile splits, a cap of 1-3 tiles more splits, up to the grid's; each gives the
    reference's result."""
    from tpgraph.kernels.decode_attention import splits_in_use

    q, k, v, bt, lens, scale = random_paged_case(6, "cpu", torch.float32, max_batch=2, max_len=1500)
    lens[0] = 1500
    used = splits_in_use(64, 1500, 16, long_split_tiles, merge_splits=MERGE_SPLITS)
    assert used == min(64, -(-1500 // (16 * long_split_tiles)))
    assert used > splits_in_use(64, 1500, 16, merge_splits=MERGE_SPLITS)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=1500, num_splits=64, split_tiles=1,
                                    block_n=16, long_split_tiles=long_split_tiles)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


def test_a_grid_that_fits_one_wave_takes_more_long_splits(monkeypatch):
    """merge_split_cap: a long sequence takes up to WIDE_MERGE_SPLITS (32) splits where the (sequence, KV head)
    pairs x 32 fit the SMs (batch 1 at 4 KV heads on 132 SMs), else MERGE_SPLITS (16): at 4096 tokens on a 64-split
    grid, 32 two-tile splits against 16 four-tile ones. TPGRAPH_ATTN_MERGE_SPLITS forces it, another value is refused
    by name, and a forced 32 gives the reference's result."""
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.decode_attention import merge_split_cap, splits_in_use

    monkeypatch.delenv("TPGRAPH_ATTN_MERGE_SPLITS", raising=False)
    assert merge_split_cap(1, 4, 132) == 32 and merge_split_cap(2, 4, 132) == 16 and merge_split_cap(1, 8, 132) == 16
    assert merge_split_cap(1, 4, 127) == 16  # 128 programs no longer fit
    assert splits_in_use(64, 4096, merge_splits=32) == 32 and splits_in_use(64, 4096, merge_splits=16) == 16
    assert splits_in_use(64, 32768, merge_splits=32) == splits_in_use(64, 32768, merge_splits=16) == 64  # 8-tile splits
    monkeypatch.setenv("TPGRAPH_ATTN_MERGE_SPLITS", "32")
    assert merge_split_cap(8, 4, 132) == 32
    q, k, v, bt, lens, scale = random_paged_case(6, "cpu", torch.float32, max_batch=2, max_len=1500)
    lens[0] = 1500
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=1500, num_splits=64, split_tiles=1,
                                    block_n=16)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))
    monkeypatch.setenv("TPGRAPH_ATTN_MERGE_SPLITS", "12")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_MERGE_SPLITS must be one of 8, 16, 32, 64"):
        merge_split_cap(1, 4, 132)


def test_merge_and_split_caps_must_be_positive():
    q, k, v, bt, lens, scale = random_paged_case(6, "cpu", torch.float32, max_batch=1, max_len=64)
    for bad in (dict(long_split_tiles=0), dict(combine_rows=0), dict(merge_splits=0)):
        with pytest.raises(ValueError, match="long_split_tiles, merge_splits and combine_rows"):
            paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=64, **bad)


# the pointers and strides a real launch finds multiples of 16 (Triton then vectorizes, and copies tiles async)
_ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "block_tables_ptr", "out_ptr", "part_acc_ptr", "stride_qb", "stride_qh",
            "stride_cb", "stride_ct", "stride_ch", "stride_bt")


def _split_kernel_ptx(pdl: bool = True, newest_apart: bool = False, prefetch_tiles: int = 0,
                     late_trigger: bool = False, kv_ahead: int = 0, aligned: bool = False,
                     num_stages: int = 2, polled: bool = False, group: int = 4, usage: bool = False,
                     splits: int = 8, dim: int = 128, num_warps: int = 4):
    """_decode_split_kernel's PTX for sm_90: bf16, a query group of 4, 128-dim heads, 8 one-tile splits merged by the
    last one, 4 warps (usage: and ptxas's resource usage, sm90_ptx_and_usage)."""
    typed = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
             "part_l_ptr": "*fp32", "counter_ptr": "*i32", "qk_scale": "fp32"}
    compile_ = sm90_ptx_and_usage if usage else sm90_ptx
    return compile_("tpgraph.kernels.decode_attention", "_decode_split_kernel", typed,
                    ["stride_qb", "stride_qh", "stride_cb", "stride_ct", "stride_ch", "stride_bt",
                     "stride_ob", "stride_oh", "stride_pb", "stride_ph", "stride_ps"],
                    {"GROUP": group, "GROUP_PAD": 16, "BLOCK_SIZE": 16, "HEAD_DIM": dim, "DIM_PAD": dim,
                     "BLOCK_N": decode_attention.BLOCK_N, "NUM_SPLITS": splits, "SPLIT_TILES": 1,
                     "DOT_PRECISION": "tf32",
                     "INTERPRETED": False, "LAST_COMBINES": True, "PDL": pdl, "GROUP_P2": group, "COMBINE_CHUNK": 8,
                     "NEWEST_APART": newest_apart, "PREFETCH_TILES": prefetch_tiles, "LINE": 64, "LINES": 2,
                     "LATE_TRIGGER": late_trigger, "KV_AHEAD": kv_ahead,
                     "LONG_TILES": decode_attention.LONG_SPLIT_TILES, "MERGE": decode_attention.MERGE_SPLITS,
                     "SPLITS_P2": splits, "POLLED": polled},
                    num_warps=num_warps, num_stages=num_stages, divisible=_ALIGNED if aligned else ())


def test_the_polled_merge_takes_the_counted_kernels_registers():
    """The model's launch (reading ahead, 3 stages, the newest row apart, aligned): polling adds no more than a few
    registers a thread and spills nothing, so as many programs share an SM as with the count (a retry loop around
    the chunk's merge had taken 226 against 134)."""
    shape = dict(newest_apart=True, kv_ahead=1, aligned=True, num_stages=3, usage=True)
    _, counted = _split_kernel_ptx(**shape)
    _, polled = _split_kernel_ptx(polled=True, **shape)
    assert polled["REG"] <= counted["REG"] + 8 and polled["STACK"] == 0


@pytest.mark.parametrize("group", [1, 4])
def test_the_polled_merge_compiles_for_sm90_without_a_count(group):
    """sm_90a, POLLED: no atomic; the partners' partials are read volatile (past L1) after the wait, a trap stands
    behind each poll's limit, and a barrier between the output's store (after the merge's last loads) and the
    sentinel's stores, which other threads make (at a group of 1 no layout change puts one there by chance)."""
    ptx = _split_kernel_ptx(polled=True, group=group)
    assert "atom.global" not in ptx and "trap;" in ptx
    assert "ld.volatile.global" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.volatile.global")
    sentinel = re.search(r"mov\.b32\s+%r\d+, 2142952365;", ptx)  # 0x7FBADBAD into a register, for the stores
    output = [m.end() for m in re.finditer(r"st\.global(\.v\d)?\.b16", ptx[:sentinel.start()])]  # bf16 out
    assert output and "bar.sync" in ptx[output[-1]:sentinel.start()]


@pytest.mark.parametrize("pdl", [False, True])
def test_the_last_split_variant_compiles_for_sm90(pdl):
    """Ahead of time, without a GPU: the arrival count is an acq_rel atomic and the partials are read past L1; as a
    programmatic dependent, the first tile's older K/V rows and the newest row's place are loaded before the wait
    (they do not depend on the kernel before), the next kernel is let in right after the wait, and q and the newest
    row are loaded after it."""
    ptx = _split_kernel_ptx(pdl=pdl)
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    assert_semaphore_order(ptx)
    if pdl:
        wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        before, after = ptx[:wait], ptx[trigger:]
        assert wait < trigger and "ld.global" not in ptx[wait:trigger]
        assert before.count("ld.global") >= 3  # the length, the block ids, the K and V rows: prefetched
        assert after.count("ld.global") >= 3  # q, the newest K and V rows (and the later tiles)
        # before the first tile's dot only q and the newest row (one K and one V vector, its block id read before the
        # wait) are loaded: in this compile (unaligned strides, so no vector loads) 16 + 2, where reloading the newest
        # row as whole [BLOCK_N, D] tiles with their block ids took 208
        assert ptx[trigger:ptx.index("mma.sync", trigger)].count("ld.global") <= 24
    else:
        assert "griddepcontrol" not in ptx


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_late_trigger_lets_the_next_kernel_in_after_the_tiles(pipelined):
    """The late trigger's kernel (sm_90, ahead of time): the wait first, then every K/V tile's dot, and only then the
    next kernel let in, before the partials are stored and counted; also in the kernel the defaults launch from batch
    2 (the newest row apart, the read-ahead at 3 stages)."""
    extra = dict(newest_apart=True, kv_ahead=1, aligned=True, num_stages=3) if pipelined else {}
    ptx = _split_kernel_ptx(late_trigger=True, **extra)
    wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert wait < ptx.index("mma.sync") and ptx.rindex("mma.sync") < trigger
    assert trigger < ptx.index("atom.global.gpu.acq_rel.add")
    assert "st.global" not in ptx[wait:trigger]  # the partials come after it


def test_the_late_trigger_setting_is_read_by_name(monkeypatch):
    from tpgraph.errors import ConfigError

    monkeypatch.delenv("TPGRAPH_ATTN_LATE_TRIGGER", raising=False)
    assert not decode_attention.attention_late_trigger(1)  # batch 1: o_proj's resident tiles load beside attention
    assert decode_attention.LATE_TRIGGER_MIN_BATCH == 2
    assert decode_attention.attention_late_trigger(2) and decode_attention.attention_late_trigger(32)
    monkeypatch.setenv("TPGRAPH_ATTN_LATE_TRIGGER", "1")
    assert decode_attention.attention_late_trigger(1)
    monkeypatch.setenv("TPGRAPH_ATTN_LATE_TRIGGER", "0")
    assert not decode_attention.attention_late_trigger(8)
    monkeypatch.setenv("TPGRAPH_ATTN_LATE_TRIGGER", "yes")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_LATE_TRIGGER"):
        decode_attention.attention_late_trigger(8)


@pytest.mark.parametrize("last_combines", ["0", "1"])
def test_a_grid_sized_for_a_long_context_splits_the_actual_one(monkeypatch, last_combines):
    """Splits follow each sequence's length, not max_seq_len: 16 splits over contexts of at most 200 tokens use at
    most 4 tiles' worth of them (the rest exit), and the result is the reference's either way it is merged."""
    from tpgraph.kernels._counters import split_counters

    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", last_combines)
    q, k, v, bt, lens, scale = random_paged_case(5, "cpu", torch.float32, max_batch=4, max_len=200)
    lens[1] = 1  # one token: the newest row alone
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=4096, num_splits=16)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))
    assert not split_counters(q.device, q.shape[0] * k.shape[2]).any()


@triton.jit
def _span_probe(lens_ptr, out_ptr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
                LONG_TILES: tl.constexpr = decode_attention.LONG_SPLIT_TILES,
                MERGE: tl.constexpr = decode_attention.MERGE_SPLITS):
    i = tl.program_id(0)
    per_split, used = decode_attention._split_span(tl.load(lens_ptr + i), NUM_SPLITS, BLOCK_N, SPLIT_TILES,
                                                   LONG_TILES, MERGE)
    tl.store(out_ptr + 2 * i, per_split)
    tl.store(out_ptr + 2 * i + 1, used)


@pytest.mark.parametrize("split_tiles", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 16, 64])
def test_each_sequence_is_split_by_its_own_length(num_splits, split_tiles):
    """(tokens per split, splits in use) per length: whole tiles, at least split_tiles of them, at most the grid's
    splits, every split in use non-empty and together covering the sequence; a padded row (0 tokens) uses one empty
    split."""
    lens = [0, 1, 64, 65, 200, 512, 1024, 1025, 4096, 5000, 8192, 32768]
    out = torch.zeros(2 * len(lens), dtype=torch.int32)
    _span_probe[(len(lens),)](torch.tensor(lens, dtype=torch.int32), out, NUM_SPLITS=num_splits, BLOCK_N=BLOCK_N,
                              SPLIT_TILES=split_tiles)
    got = [tuple(out[2 * i:2 * i + 2].tolist()) for i in range(len(lens))]
    for n, (per_split, used) in zip(lens, got, strict=True):
        assert per_split % BLOCK_N == 0 and per_split >= split_tiles * BLOCK_N and 1 <= used <= num_splits
        assert (used - 1) * per_split < max(n, 1) <= used * per_split  # none empty (but a padded row's), all covered
    if num_splits == 16:  # a 512-token context on a 16-split grid: 8 splits of one tile (or 4 of two), not 16
        assert got[lens.index(512)] == ((64, 8) if split_tiles == 1 else (128, 4))
        assert got[lens.index(5000)] == (320, 16)
    elif num_splits == 64:  # long sequences: at most MERGE_SPLITS splits until they would pass 8 tiles each
        assert got[lens.index(512)] == ((64, 8) if split_tiles == 1 else (128, 4))
        assert got[lens.index(4096)] == (256, 16)
        assert got[lens.index(8192)] == (512, 16)
        assert got[lens.index(32768)] == (512, 64)
    else:
        assert all(used == 1 for _, used in got)


@pytest.mark.parametrize("newest_apart", [False, True])
@pytest.mark.parametrize(("block_n", "num_splits"), [(16, 1), (16, 3), (32, 2)])
@pytest.mark.parametrize("seed", [0, 10, 22])
def test_reading_the_next_tile_ahead_gives_the_same_bits(seed, block_n, num_splits, newest_apart):
    """KV_AHEAD 1 (the next tile's cache places a tile early) and 2 (its K/V too, the second tile before the wait
    with the newest row apart) attend the same tiles in the same order as 0: splits of up to 19 tiles of 16 tokens,
    with the newest row in a later tile, and padded rows."""
    q, k, v, bt, lens, scale = random_paged_case(seed, "cpu", torch.float32, max_batch=3, max_len=300)
    outs = [paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=300, num_splits=num_splits,
                                      newest_apart=newest_apart, block_n=block_n, kv_ahead=ahead)
            for ahead in (0, 1, 2)]
    _check(outs[0], paged_decode_reference(q, k, v, bt, lens, scale))
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_the_read_ahead_carries_the_next_tiles_places_with_a_16_bit_cache_at_3_stages(monkeypatch):
    from tpgraph.errors import ConfigError

    monkeypatch.delenv("TPGRAPH_ATTN_KV_AHEAD", raising=False)
    monkeypatch.delenv("TPGRAPH_ATTN_STAGES", raising=False)
    assert kv_lookahead(torch.bfloat16) == 1 and kv_lookahead(torch.float16) == 1
    assert attention_stages(kv_lookahead(torch.bfloat16)) == 3  # pipelined: the next tile's copies in flight
    assert kv_lookahead(torch.float32) == 0  # fp32's 3-stage tiles would take about 140 KB of shared memory
    assert attention_stages(kv_lookahead(torch.float32)) == 2
    monkeypatch.setenv("TPGRAPH_ATTN_KV_AHEAD", "0")
    assert kv_lookahead(torch.bfloat16) == 0
    monkeypatch.setenv("TPGRAPH_ATTN_KV_AHEAD", "2")
    assert kv_lookahead(torch.float32) == 2
    monkeypatch.setenv("TPGRAPH_ATTN_KV_AHEAD", "3")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_KV_AHEAD must be one of 0, 1, 2"):
        kv_lookahead(torch.bfloat16)


@pytest.mark.parametrize(("kv_ahead", "dtype", "ahead", "stages"), [
    (None, torch.bfloat16, 1, 3), (None, torch.float32, 0, 2), (2, torch.bfloat16, 2, 2), (0, torch.bfloat16, 0, 2)])
def test_the_launch_takes_its_stages_from_the_read_ahead_it_resolved(monkeypatch, kv_ahead, dtype, ahead, stages):
    """paged_decode_attention_v2 asks kv_lookahead with the cache's dtype (unless kv_ahead is given) and then
    attention_stages with the read-ahead it resolved, and launches with both; a kv_ahead other than 0, 1, 2 is refused
    before any launch."""
    monkeypatch.delenv("TPGRAPH_ATTN_KV_AHEAD", raising=False)
    monkeypatch.delenv("TPGRAPH_ATTN_STAGES", raising=False)
    q, k, v, bt, lens, scale = random_paged_case(0, "cpu", torch.float32, max_batch=3, max_len=70)
    asked, launched = [], []
    rule, stages_rule = decode_attention.kv_lookahead, decode_attention.attention_stages
    monkeypatch.setattr(decode_attention, "kv_lookahead", lambda d: asked.append(d) or rule(dtype))
    monkeypatch.setattr(decode_attention, "attention_stages", lambda a: launched.append(a) or stages_rule(a))
    kernel = decode_attention._decode_split_kernel

    class Spy:  # the launch's KV_AHEAD and num_stages, then the real kernel
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["KV_AHEAD"], kwargs["num_stages"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode_attention, "_decode_split_kernel", Spy())
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=70, num_splits=3, kv_ahead=kv_ahead)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))
    assert asked == ([q.dtype] if kv_ahead is None else [])
    assert launched == [ahead, (ahead, stages)]
    with pytest.raises(ValueError, match="kv_ahead must be 0, 1 or 2"):
        paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=70, kv_ahead=3)


@pytest.mark.parametrize(("num_splits", "split_tiles"), [(3, 1), (2, 2), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("newest_apart", [False, True])
def test_the_newest_row_apart_or_merged_matches_the_reference(dtype, newest_apart, num_splits, split_tiles):
    """The newest row apart and merged (newest_apart_for picks one by batch). One-tile splits (3, 1) put the newest
    row alone in a split's first tile (65: split 1 holds token 64 only; 1: the whole sequence), at a split's last row
    (64), beside one other row (130: split 2 holds tokens 128-129), and in a padded row (0). Longer splits put it in a
    split's later tile, where it must not be counted twice: two-tile splits (2, 2) at 65 (one split, tokens 0-64), one
    split at 65 and 130."""
    q, k, v, bt, _, scale = random_paged_case(17, "cpu", dtype, max_batch=5, max_len=140)  # 5 rows, group 8
    lens = torch.tensor([65, 1, 64, 130, 0][: q.shape[0]], dtype=torch.int32)
    assert q.shape[0] == 5 and k.shape[1] * bt.shape[1] >= 130
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=140, num_splits=num_splits,
                                    split_tiles=split_tiles, newest_apart=newest_apart)
    ref = paged_decode_reference(q, k, v, bt, lens, scale)
    if dtype == torch.float32:
        _check(out, ref)
    else:
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_the_newest_row_apart_stages_the_first_tile_before_the_wait():
    """Ahead of time, without a GPU: with the newest row apart, the first tile (loaded before the PDL wait) is no
    longer rewritten after it, so most of its staging into shared memory for the dot moves before the wait: in this
    compile (unaligned strides) 144 st.shared between the trigger and the first mma with the row merged, 25 apart
    (Triton 3.9; 38 with the device's 3.6)."""
    staged = {}
    for apart in (False, True):
        ptx = _split_kernel_ptx(newest_apart=apart)
        wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        staged[apart] = (ptx[:wait].count("st.shared"), ptx[trigger:ptx.index("mma.sync", trigger)].count("st.shared"))
    assert staged[False][0] == 0 and staged[True][0] > 0
    assert staged[True][1] * 3 < staged[False][1]


def test_reading_ahead_loads_the_second_tile_before_the_wait_and_the_loop_without_async_copies():
    """Ahead of time, without a GPU: with KV_AHEAD 2 and the newest row apart, the second tile's K and V (older rows)
    are loaded before the PDL wait too, twice the first tile's vector loads; with the newest row merged they wait for
    it. The loop then loads into registers, with no async copy that its next turn would wait out. Without the
    read-ahead the loop's tiles go through cp.async, waited for (wait_group 0) at the top of the next turn."""
    def before_wait(ptx: str) -> int:
        return ptx[:ptx.index("griddepcontrol.wait")].count("ld.global.v4")

    plain = _split_kernel_ptx(newest_apart=True, aligned=True)
    ahead = _split_kernel_ptx(newest_apart=True, kv_ahead=2, aligned=True)
    merged = _split_kernel_ptx(newest_apart=False, kv_ahead=2, aligned=True)
    assert before_wait(plain) > 0 and before_wait(ahead) == 2 * before_wait(plain)
    assert before_wait(merged) == before_wait(_split_kernel_ptx(newest_apart=False, aligned=True))
    assert re.search(r"cp\.async\.wait_group\s+0", plain) and "cp.async" not in ahead and "cp.async" not in merged
    # with the L2 prefetch, ahead of the tile the loop loads next (one later when it reads ahead)
    assert "prefetch.global.L2" in _split_kernel_ptx(newest_apart=True, kv_ahead=2, prefetch_tiles=2, aligned=True)


@pytest.mark.parametrize("newest_apart", [True, False])
def test_more_stages_pipeline_the_tile_loop_only_when_it_reads_the_next_places_ahead(newest_apart):
    """Ahead of time, without a GPU: Triton's pipeliner leaves the loop whose K/V addresses come from a block-table
    load in the same turn unpipelined at 3 stages (it waits for every copy, wait_group 0); with the places carried
    from the turn before (KV_AHEAD 1), 3 stages keep the next tile's K and V copies in flight (wait_group 2), with the
    newest row apart (from batch 2) and merged (batch 1) alike: the defaults' kernels."""
    def waits(ptx: str) -> set[int]:
        return {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)}

    assert waits(_split_kernel_ptx(newest_apart=newest_apart, aligned=True, num_stages=3)) == {0}
    assert max(waits(_split_kernel_ptx(newest_apart=newest_apart, kv_ahead=1, aligned=True, num_stages=3))) == 2


def test_the_stages_setting_is_read_by_name(monkeypatch):
    from tpgraph.errors import ConfigError

    monkeypatch.delenv("TPGRAPH_ATTN_STAGES", raising=False)
    assert attention_stages(0) == 2 and attention_stages(2) == 2
    assert attention_stages(1) == 3
    monkeypatch.setenv("TPGRAPH_ATTN_STAGES", "4")
    assert attention_stages(1) == 4
    monkeypatch.setenv("TPGRAPH_ATTN_STAGES", "3")
    assert attention_stages(0) == 3
    monkeypatch.setenv("TPGRAPH_ATTN_STAGES", "5")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_STAGES must be one of 2, 3, 4"):
        attention_stages(1)


def test_the_warps_setting_is_read_by_name_and_reaches_the_launch(monkeypatch):
    """4 warps unless TPGRAPH_ATTN_WARPS says 8; another value is refused by name. A forced 8 launches (the
    interpreter runs it) and gives the default's result."""
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.decode_attention import attention_warps

    monkeypatch.delenv("TPGRAPH_ATTN_WARPS", raising=False)
    assert attention_warps() == 4
    q, k, v, bt, lens, scale = random_paged_case(6, "cpu", torch.float32, max_batch=2, max_len=200)
    four = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=200)
    monkeypatch.setenv("TPGRAPH_ATTN_WARPS", "8")
    assert attention_warps() == 8
    torch.testing.assert_close(paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=200), four)
    monkeypatch.setenv("TPGRAPH_ATTN_WARPS", "6")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_WARPS must be one of 4, 8"):
        attention_warps()


@pytest.mark.parametrize(("value", "batch", "expected"), [
    ("", 1, False), ("", 2, True), ("", 8, True), ("1", 1, True), ("0", 8, False)])
def test_the_newest_row_is_apart_from_two_sequences_unless_forced(monkeypatch, value, batch, expected):
    from tpgraph.errors import ConfigError

    monkeypatch.setenv("TPGRAPH_ATTN_NEWEST_APART", value)
    assert newest_apart_for(batch) is expected
    monkeypatch.setenv("TPGRAPH_ATTN_NEWEST_APART", "yes")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_NEWEST_APART must be 0 or 1"):
        newest_apart_for(batch)


def test_four_tile_splits_match_the_reference():
    """split_tiles=4 (more than the batch rule ever picks): a 512-token row in two splits, a 200-token one in one,
    still the reference, and split_tiles reaches the launch (other bits than 1-tile splits)."""
    q, k, v, bt, _, scale = random_paged_case(5, "cpu", torch.float32, max_batch=3, max_len=600)
    lens = torch.tensor([512, 200, 71], dtype=torch.int32)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=600, split_tiles=4)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))
    assert not torch.equal(out, paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=600, split_tiles=1))


@pytest.mark.parametrize("prefetch_tiles", [0, 2, 8])
def test_the_l2_prefetch_asks_for_the_next_tiles_before_the_wait(prefetch_tiles):
    """Ahead of time, without a GPU: each of the 128 threads asks L2 for its share of the next tiles' K and V lines
    (tiles x 64 tokens x 2 lines x 2 caches / 128 threads) before the PDL wait, then for one tile's share a turn of
    the loop (after the wait), and for none when off."""
    ptx = _split_kernel_ptx(prefetch_tiles=prefetch_tiles)
    wait = ptx.index("griddepcontrol.wait")
    assert ptx[:wait].count("prefetch.global.L2") == prefetch_tiles * BLOCK_N * 2 * 2 // 128
    assert ptx[wait:].count("prefetch.global.L2") == (BLOCK_N * 2 * 2 // 128 if prefetch_tiles else 0)


def test_the_l2_prefetch_budget_rule():
    """Powers of two up to MAX_PREFETCH_TILES, as many as keep the grid within half the L2, 0 when even one does not
    fit: batch 32's 384 programs of 32 KB tiles on a 50 MB L2 take 2, a small grid 8."""
    tile = 2 * 64 * 128 * 2
    l2 = 50 << 20
    assert l2_prefetch_tiles(384, tile, l2) == 2
    assert l2_prefetch_tiles(64, tile, l2) == MAX_PREFETCH_TILES == 8
    assert l2_prefetch_tiles(4096, tile, l2) == 0
    for programs in (1, 100, 200, 400, 800, 1600):
        tiles = l2_prefetch_tiles(programs, tile, l2)
        assert tiles in (0, 1, 2, 4, 8) and programs * tiles * tile <= l2 // 2
        assert tiles == MAX_PREFETCH_TILES or programs * max(1, 2 * tiles) * tile > l2 // 2


@pytest.mark.parametrize(("long_tiles", "merge"), [(4, 16), (8, 16), (8, 32), (8, 64)])
@pytest.mark.parametrize("max_seq_len", [512, 4096, 8192, 32768, 131072])
@pytest.mark.parametrize("num_splits", [3, 16, 64, 128])
def test_splits_in_use_bound_what_each_length_uses(max_seq_len, num_splits, long_tiles, merge):
    """splits_in_use is an upper bound on _split_span's splits for every length up to max_seq_len, and reached by
    one (the prefetch budget counts those programs, not the grid's), whatever the long splits' caps."""
    lens = sorted({1, 64, 511, 512, 1000, 4095, 4096, 8191, 8192, 20000, 32768, 131072} & set(range(max_seq_len + 1))
                  | {max_seq_len})
    out = torch.zeros(2 * len(lens), dtype=torch.int32)
    _span_probe[(len(lens),)](torch.tensor(lens, dtype=torch.int32), out, NUM_SPLITS=num_splits, BLOCK_N=BLOCK_N,
                              SPLIT_TILES=1, LONG_TILES=long_tiles, MERGE=merge)
    used = out.view(-1, 2)[:, 1].tolist()
    assert max(used) == splits_in_use(num_splits, max_seq_len, BLOCK_N, long_tiles, merge_splits=merge)


def test_the_l2_prefetch_is_off_unless_asked_and_off_cuda(monkeypatch):
    from tpgraph.errors import ConfigError

    q = torch.zeros(32, 16, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("TPGRAPH_ATTN_L2_PREFETCH", raising=False)
    assert l2_prefetch_tiles_for(q, 4, 3, 8192, merge_splits=16) == 0
    monkeypatch.setenv("TPGRAPH_ATTN_L2_PREFETCH", "1")
    assert l2_prefetch_tiles_for(q, 4, 3, 8192, merge_splits=16) == 0  # a CPU tensor: nothing to prefetch
    monkeypatch.setenv("TPGRAPH_ATTN_L2_PREFETCH", "on")
    with pytest.raises(ConfigError, match="TPGRAPH_ATTN_L2_PREFETCH must be 0 or 1"):
        l2_prefetch_tiles_for(q, 4, 3, 8192, merge_splits=16)


def test_an_l2_prefetch_that_is_not_a_power_of_two_is_refused_and_one_changes_nothing_off_cuda():
    q, k, v, bt, lens, scale = random_paged_case(5, "cpu", torch.float32, max_batch=3, max_len=300)
    with pytest.raises(ValueError, match="l2_prefetch must be 0 or a power of two"):
        paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=300, l2_prefetch=3)
    with pytest.raises(ValueError, match="a power of two up to 8"):
        paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=300, l2_prefetch=16)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=300, num_splits=2, l2_prefetch=4)
    _check(out, paged_decode_reference(q, k, v, bt, lens, scale))


@pytest.mark.parametrize(("group", "splits", "dim", "warps"), [(4, 8, 128, 4), (1, 8, 128, 4), (4, 64, 128, 4),
                                                            (4, 8, 128, 8), (1, 8, 64, 4)])
def test_the_polled_merge_branches_on_counts_its_warps_share(group, splits, dim, warps):
    """sm_90a: every branch on a poll's count of stale partials taken by the whole block (the count went through
    shared memory) depends on no register loaded from the partials. The maxima and sums of a chunk are loaded by
    every warp (replicated), and a warp that read a sum a moment before a partner stored it counted it stale while the
    others did not: a count with that warp's own term added took the retry's block barriers in some warps only, and
    at batch 32 the reducers hung until the poll limit's trap (bench/results/2026-12-03_h200_polled_attention_fix).
    At 8 splits the first poll of the maxima is each warp's own (its loop holds no barrier), so the block's counts
    are the merge's four: the chunk's, the retry loop's, its limit's and the merge's again; at 64 splits the first
    poll's three are the block's too. Shapes: the model's (a group of 4, 128 dims), a group of 1, 64 splits, 8
    warps, and 64-dim heads."""
    ptx = _split_kernel_ptx(polled=True, group=group, newest_apart=True, kv_ahead=1, aligned=True, num_stages=3,
                            splits=splits, dim=dim, num_warps=warps)
    block_counts = [sources for sources in branch_sources(ptx) if "ld.shared.b32" in sources]
    assert len(block_counts) == (4 if splits == 8 else 7)
    for sources in block_counts:
        assert not any(op.startswith("ld.volatile") for op in sources), sorted(sources)
