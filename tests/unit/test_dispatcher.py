import pytest

from tpgraph.errors import ConfigError
from tpgraph.graphs.dispatcher import BatchDescriptor, Dispatcher, GraphMode
from tpgraph.graphs.ladder import capture_sizes, sglang_ladder, vllm_ladder

LADDERS = {"vllm": vllm_ladder(), "sglang": sglang_ladder(), "explicit": (3, 7, 64), "one": (1,)}


def smallest_rung_at_least(n, rungs):
    """Brute force, independent of the dispatcher's table."""
    return min(r for r in rungs if r >= n)


@pytest.mark.parametrize("name", LADDERS)
def test_every_batch_pads_to_smallest_rung(name):
    rungs = LADDERS[name]
    d = Dispatcher(rungs, rungs)
    for n in range(1, max(rungs) + 1):
        want = smallest_rung_at_least(n, rungs)
        assert d.padded_size(n, GraphMode.FULL) == want, n
        assert d.padded_size(n, GraphMode.PIECEWISE) == want, n
        mode, desc = d.dispatch(n, n, True)
        assert (mode, desc.num_tokens, desc.num_real_tokens, desc.padding) == (GraphMode.FULL, want, n, want - n)
        mode, desc = d.dispatch(n, 1, False)
        assert (mode, desc.num_tokens) == (GraphMode.PIECEWISE, want), n


@pytest.mark.parametrize("max_batch", [100, 300, 600])
@pytest.mark.parametrize("ladder", ["vllm", "sglang"])
def test_capture_sizes_then_dispatch_cover_max_batch(ladder, max_batch):
    sizes = capture_sizes(ladder, max_batch)
    d = Dispatcher(sizes, ())
    for n in range(1, max_batch + 1):
        mode, desc = d.dispatch(n, n, True)
        assert mode is GraphMode.FULL
        assert desc.num_tokens == smallest_rung_at_least(n, sizes)


def test_named_padding_cases():
    sglang, vllm = Dispatcher(sglang_ladder(), ()), Dispatcher(vllm_ladder(), ())
    assert sglang.padded_size(9, GraphMode.FULL) == 12
    assert vllm.padded_size(9, GraphMode.FULL) == 16
    assert sglang.padded_size(13, GraphMode.FULL) == 16
    assert vllm.padded_size(13, GraphMode.FULL) == 16
    assert vllm.padded_size(100, GraphMode.FULL) == 104


def test_full_needs_uniform_decode():
    d = Dispatcher(full_sizes=(1, 2, 4, 8), piecewise_sizes=(16, 64))
    assert d.dispatch(3, 3, True) == (GraphMode.FULL, BatchDescriptor(4, 3, 3, True))
    # a mixed batch (some sequence contributes several tokens) never takes a FULL graph
    assert d.dispatch(3, 2, False) == (GraphMode.PIECEWISE, BatchDescriptor(16, 2, 3, False))
    # a uniform batch larger than the largest FULL size falls to PIECEWISE, keyed on token count
    assert d.dispatch(9, 9, True) == (GraphMode.PIECEWISE, BatchDescriptor(16, 9, 9, True))
    assert d.dispatch(64, 5, False) == (GraphMode.PIECEWISE, BatchDescriptor(64, 5, 64, False))


def test_above_every_bucket_runs_eager_unpadded():
    d = Dispatcher(full_sizes=(1, 2, 4, 8), piecewise_sizes=(16, 64))
    mode, desc = d.dispatch(65, 3, False)
    assert mode is GraphMode.NONE
    assert desc == BatchDescriptor(65, 3, 65, False)
    assert desc.padding == 0
    assert d.dispatch(65, 65, True)[0] is GraphMode.NONE
    assert d.padded_size(65, GraphMode.NONE) == 65


def test_empty_size_lists_turn_a_mode_off():
    no_full = Dispatcher((), (8,))
    assert no_full.dispatch(1, 1, True)[0] is GraphMode.PIECEWISE
    eager = Dispatcher([], [])
    assert eager.full_sizes == () and eager.piecewise_sizes == ()
    assert eager.dispatch(1, 1, True) == (GraphMode.NONE, BatchDescriptor(1, 1, 1, True))
    with pytest.raises(ConfigError, match="no full graph holds 1 tokens: none were captured"):
        eager.padded_size(1, GraphMode.FULL)


def test_breakable_pads_like_full():
    """Breakable decode is keyed like FULL (the runner builds its dispatcher with full sizes only): a batch pads to
    the full bucket, not to a piecewise size (none were captured)."""
    d = Dispatcher((1, 2, 4, 8), ())
    assert d.padded_size(3, GraphMode.BREAKABLE) == 4
    with pytest.raises(ConfigError, match="no breakable graph holds 9 tokens: the largest is 8"):
        d.padded_size(9, GraphMode.BREAKABLE)
    assert Dispatcher((1, 4), (16,)).padded_size(3, GraphMode.BREAKABLE) == 4


def test_sizes_are_sorted_and_exposed():
    d = Dispatcher(iter([8, 1, 4]), [32, 16])
    assert d.full_sizes == (1, 4, 8)
    assert d.piecewise_sizes == (16, 32)


def test_errors():
    d = Dispatcher((1, 2, 4), (8,))
    for n in (0, -1):
        with pytest.raises(ConfigError, match="at least one token"):
            d.dispatch(n, 1, False)
        with pytest.raises(ConfigError, match="n >= 1"):
            d.padded_size(n, GraphMode.FULL)
    with pytest.raises(ConfigError, match="no full graph holds 5 tokens: the largest is 4"):
        d.padded_size(5, GraphMode.FULL)
    with pytest.raises(ConfigError, match="repeats"):
        Dispatcher((1, 1), ())
    with pytest.raises(ConfigError, match="piecewise_sizes entry 0 is not positive"):
        Dispatcher((1,), (0, 8))


def test_descriptor_validates_batch():
    with pytest.raises(ConfigError, match="one token per sequence"):
        BatchDescriptor(4, 2, 3, True)
    with pytest.raises(ConfigError, match="num_reqs"):
        BatchDescriptor(4, 0, 3, False)
    with pytest.raises(ConfigError, match="num_tokens"):
        BatchDescriptor(2, 1, 3, False)
    d = Dispatcher((1, 2, 4), ())
    with pytest.raises(ConfigError, match="one token per sequence"):
        d.dispatch(3, 2, True)
