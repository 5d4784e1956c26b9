"""tpgraph/engine/argmax.py: the two-stage argmax and the one-launch kernel give torch.argmax's answer: first maximum,
NaN as maximum."""

import os

import pytest
import torch
from tpgtest.launches import spy_launches

from tpgraph.engine.argmax import chunks_for, row_argmax


def test_chunks_divide_the_vocabulary_into_pieces_of_at_least_64():
    assert chunks_for(128256) == 501  # Llama-3: 501 chunks of 256
    assert chunks_for(32000) == 500
    assert chunks_for(32003) == 1  # prime: the plain argmax
    assert chunks_for(100) == 1  # too short to split
    for vocab in (128256, 32000, 151936, 4096, 49152):
        c = chunks_for(vocab)
        assert vocab % c == 0 and (c == 1 or vocab // c >= 64)


@pytest.mark.parametrize("vocab", [128256, 32000, 49152, 32003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax_on_random_rows(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g).to(dtype)
    assert torch.equal(row_argmax(x, two_stage=True), x.argmax(dim=-1))


def test_ties_give_the_first_maximum_even_across_chunks():
    vocab = 32000  # 500 chunks of 64
    x = torch.zeros(4, vocab)
    x[0, [70, 63, 64, 31999]] = 5.0  # chunk 0 (63) before chunk 1 (64, 70)
    x[1, [128, 129]] = 2.0  # two in one chunk
    x[2, 31999] = 1.0  # the very last entry
    # row 3: all equal: index 0
    assert row_argmax(x, two_stage=True).tolist() == [63, 128, 31999, 0]
    assert torch.equal(row_argmax(x, two_stage=True), x.argmax(dim=-1))


def test_nan_counts_as_the_maximum_as_in_torch_argmax():
    x = torch.randn(2, 32000)
    x[0, 12345] = float("nan")
    x[1, 7] = float("inf")
    assert row_argmax(x, two_stage=True).tolist() == x.argmax(dim=-1).tolist() == [12345, 7]


def test_mistakes_are_refused():
    with pytest.raises(ValueError, match="batch, vocab"):
        row_argmax(torch.zeros(3))
    assert row_argmax(torch.zeros(0, 32000), two_stage=True).shape == (0,)


fused_on_cpu = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel on CPU tensors needs TRITON_INTERPRET=1")


def _tricky_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, a tie across chunks and shards (5), a tie inside one (3), NaN (two: the first wins, even over
    +inf), +inf last, -inf only (index 0): where a chunked or cross-rank argmax could pick another index than
    torch.argmax of the whole row."""
    x = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x[1, [vocab - 1, 5, vocab // 2]] = 50.0
    x[2, [3, 4]] = 50.0
    x[3, [vocab - 2, vocab // 3]] = float("nan")
    x[3, 0] = float("inf")
    x[4, vocab - 1] = float("inf")
    x[5] = float("-inf")
    return x


@fused_on_cpu
@pytest.mark.parametrize("vocab", [128256, 32003, 1000, 1024, 1025])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_equals_torch_argmax(vocab, dtype):
    """TPGRAPH_FUSED_ARGMAX's one launch (kernels/argmax.py): random rows, ties within a chunk and across chunks
    (chunks of 1024), NaN (the first one wins, wherever the maximum is), +inf, and a row of -inf only."""
    pytest.importorskip("triton")
    x = _tricky_rows(vocab, dtype)
    got = row_argmax(x, fused=True)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[1].item() == 5 and got[2].item() == 3 and got[3].item() == min(vocab - 2, vocab // 3)
    assert torch.equal(row_argmax(x[:, ::2], fused=True), x[:, ::2].argmax(dim=-1))  # strided: made contiguous


@fused_on_cpu
def test_the_fused_kernel_takes_strided_rows_and_leaves_its_counters_at_zero():
    pytest.importorskip("triton")
    from tpgraph.kernels._counters import split_counters

    x = torch.randn(3, 4000)
    wide = torch.randn(3, 5000)
    wide[:, :4000] = x
    assert torch.equal(row_argmax(wide[:, :4000], fused=True), x.argmax(dim=-1))  # row stride 5000
    assert torch.equal(row_argmax(x.t().contiguous().t(), fused=True), x.argmax(dim=-1))  # column-major: copied
    assert not split_counters(x.device, 3).any()
    assert row_argmax(torch.zeros(0, 4000), fused=True).shape == (0,)


def test_the_fused_argmax_is_on_unless_turned_off_and_takes_only_what_it_compares_exactly(monkeypatch):
    """The setting (on unless 0), and the routing: CPU tensors by default, fp64 rows and more rows than the
    counters hold take torch's path even where the fused kernel is asked for."""
    import tpgraph.engine.argmax as engine_argmax
    from tpgraph.errors import ConfigError
    from tpgraph.kernels._counters import MAX_COUNTERS
    from tpgraph.kernels.argmax import fused_argmax_enabled, takes

    monkeypatch.delenv("TPGRAPH_FUSED_ARGMAX", raising=False)
    assert fused_argmax_enabled()
    monkeypatch.setenv("TPGRAPH_FUSED_ARGMAX", "0")
    assert not fused_argmax_enabled()
    monkeypatch.setenv("TPGRAPH_FUSED_ARGMAX", "1")
    assert fused_argmax_enabled()

    def refuse(x, out=None):
        raise AssertionError("the fused kernel ran")

    monkeypatch.setattr(engine_argmax, "argmax_rows", refuse)
    assert row_argmax(torch.tensor([[1.0, 3.0, 2.0]])).tolist() == [1]  # CPU tensors: torch's path
    x64 = torch.tensor([[0.0, 1.0 - 1e-12, 0.0, 1.0]], dtype=torch.float64)  # apart in fp64 only
    assert row_argmax(x64, fused=True).tolist() == [3]
    assert not takes(torch.zeros(MAX_COUNTERS + 1, 2)) and takes(torch.zeros(MAX_COUNTERS, 2))
    monkeypatch.setenv("TPGRAPH_FUSED_ARGMAX", "y")
    with pytest.raises(ConfigError, match="TPGRAPH_FUSED_ARGMAX must be 0 or 1"):
        fused_argmax_enabled()


@fused_on_cpu
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_the_ids_go_into_the_rows_given_and_a_wrong_out_is_refused(fused):
    """out: the rows the next decode step reads its pending tokens from (the runner's sampled_ids). The fused kernel
    writes them itself, torch's paths copy them in; either way the result is that tensor, and only its rows change."""
    pytest.importorskip("triton")
    x = torch.randn(3, 4000, generator=torch.Generator().manual_seed(3))
    kept = torch.full((5,), -1, dtype=torch.int64)
    got = row_argmax(x, fused=fused, two_stage=True, out=kept[:3])
    assert got.data_ptr() == kept.data_ptr() and kept[:3].tolist() == x.argmax(dim=-1).tolist()
    assert kept[3:].tolist() == [-1, -1]
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="out must be"):
            row_argmax(x, fused=fused, out=bad)


def _shards(x: torch.Tensor, world: int) -> list[tuple[torch.Tensor, int]]:
    """x's columns cut as VocabShard cuts a vocabulary: equal padded ranges, the last ones short or empty."""
    per_rank = -(-x.shape[1] // world)
    return [(x[:, min(r * per_rank, x.shape[1]):min((r + 1) * per_rank, x.shape[1])], min(r * per_rank, x.shape[1]))
            for r in range(world)]


def _summed_slots(x: torch.Tensor, world: int, fused: bool) -> torch.Tensor:
    """Every rank's slots for its shard of x, summed as the all-reduce sums them."""
    from tpgraph.engine.argmax import shard_argmax_slots

    slots = [shard_argmax_slots(part, base, rank, world, fused=fused) for rank, (part, base) in
             enumerate(_shards(x, world))]
    for rank, mine in enumerate(slots):  # each rank writes its own slot and zeros in every other
        assert mine.shape == (world, x.shape[0], 4) and mine.dtype == torch.float32
        assert not torch.cat([mine[:rank], mine[rank + 1:]]).any()
        assert torch.equal(mine, mine.round()) and mine.min() >= 0 and mine.max() < 65536  # exact under any sum
    return torch.stack(slots).sum(dim=0)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=fused_on_cpu)], ids=["torch", "fused"])
@pytest.mark.parametrize("vocab,world", [(4000, 2), (32003, 4), (2051, 3), (13, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ranks_slots_summed_combine_to_torch_argmax_of_the_gathered_row(vocab, world, dtype, fused):
    """At TP > 1 greedy decode all-reduces each rank's slot (its shard's maximum as a sortable key, and its index),
    not the logits: summed over the ranks and combined in rank order they give torch.argmax of the whole row, for
    shards as the vocabulary is cut (32003 over 4: a short last shard; 13 over 8: a last rank with no vocabulary at
    all). The kernel's slots and torch's are the same bits."""
    if fused:
        pytest.importorskip("triton")
    from tpgraph.engine.argmax import combine_slots

    x = _tricky_rows(vocab, dtype)
    summed = _summed_slots(x, world, fused)
    if fused:
        assert torch.equal(summed, _summed_slots(x, world, False))
    kept = torch.full((9,), -1, dtype=torch.int64)
    got = combine_slots(summed, out=kept[:7], fused=fused)
    assert got.data_ptr() == kept.data_ptr() and torch.equal(got, x.argmax(dim=-1)) and kept[7:].tolist() == [-1, -1]
    assert got[1].item() == 5 and got[2].item() == 3 and got[3].item() == min(vocab - 2, vocab // 3)


# fp32 values in increasing order (-0.0 and +0.0 equal), the keys' hard cases: signs, denormals, infinities, NaN
ORDERED = [float("-inf"), -3.0e38, -1.0, -1.0e-40, -0.0, 0.0, 1.0e-45, 1.0e-40, 2.0, 3.0e38, float("inf"),
           float("nan")]


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=fused_on_cpu)], ids=["torch", "fused"])
def test_the_slot_keys_order_as_the_floats_and_tie_as_torch_argmax(fused):
    """Each rank holds one value of a row (shards of one column): for every pair of the hard values, in both orders,
    the combined slots pick what torch.argmax picks: the larger, NaN above all, the first of -0.0 and +0.0, the first
    of a tie; denormals are not flushed."""
    if fused:
        pytest.importorskip("triton")
    from tpgraph.engine.argmax import combine_slots

    rows = [[a, b] for a in ORDERED for b in ORDERED] + [[v, v] for v in ORDERED]
    x = torch.tensor(rows, dtype=torch.float32)
    got = combine_slots(_summed_slots(x, 2, fused), fused=fused)
    assert torch.equal(got, x.argmax(dim=-1))
    wide = torch.tensor([ORDERED[:8], ORDERED[4:]], dtype=torch.float32).flip(1)  # 8 ranks, one column each
    assert torch.equal(combine_slots(_summed_slots(wide, 8, fused), fused=fused), wide.argmax(dim=-1))


def test_shard_slots_refuse_what_they_cannot_carry():
    from tpgraph.engine.argmax import combine_slots, shard_argmax_slots

    with pytest.raises(ValueError, match="vocab shard"):
        shard_argmax_slots(torch.zeros(2, 3, dtype=torch.float64), 0, 0, 2)
    with pytest.raises(ValueError, match="int32 index"):
        shard_argmax_slots(torch.zeros(2, 3), (1 << 31) - 2, 0, 2)
    with pytest.raises(ValueError, match="not in a world of 2"):
        shard_argmax_slots(torch.zeros(2, 3), 0, 2, 2)
    with pytest.raises(ValueError, match="world, batch, 4"):
        combine_slots(torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="out must be"):
        combine_slots(torch.zeros(2, 3, 4), out=torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_the_slots_take_the_custom_all_reduces_fastest_path_at_every_decode_batch(capability):
    """The slots' all-reduce is there because it is the cheapest exchange: the shipped tables send a slots buffer
    ([world, batch, 4] fp32) to 1shot_push, in graphs and eagerly, at every world size and decode batch up to 256."""
    from tpgraph.comm.thresholds import WORLD_SIZES, Algo, load_table_for, pick_algo

    table = load_table_for(capability)
    for world in WORLD_SIZES:
        for batch in (1, 7, 32, 256):
            for graph in (True, False):
                assert pick_algo(world * batch * 16, graph, table, world, dtype=torch.float32) == Algo.PUSH_1SHOT


@fused_on_cpu
@pytest.mark.parametrize("vocab", [258, 128256])
def test_every_batch_launches_the_fused_kernel_with_aligned_partials(monkeypatch, vocab):
    """The partials (maxima, indices, flags) each start at a 16-byte boundary whatever the batch: Triton keys a
    pointer's alignment, and packed end to end they moved with the batch size mod 4 (a served batch of 2 greedy rows
    compiled a variant the warm-up's 1, 3 and 16 had not)."""
    pytest.importorskip("triton")
    import tpgraph.kernels.argmax as fused

    pointers = lambda grid, args, kw: [a.data_ptr() % 16 for a in args if isinstance(a, torch.Tensor)]
    offsets = spy_launches(monkeypatch, fused, "_argmax_kernel", record=pointers)
    for batch in range(1, 9):
        x = torch.randn(batch, vocab)
        assert torch.equal(row_argmax(x, fused=True), x.argmax(dim=-1))
    assert len(offsets) == 8 and all(o == [0] * 7 for o in offsets), offsets
