"""How much workspace the custom all-reduce takes: a capped push slot (larger pushes go through it in pieces),
staging only for what a staged pull band reaches, and the pull bands cut to it (larger messages fall through)."""

from dataclasses import replace

from tpgraph.comm.custom_ar import CustomAllReduceConfig, size_workspace
from tpgraph.comm.thresholds import Algo, load_table_for, pick_algo

MB = 1 << 20


def table_with(ws, graph, eager):
    t = load_table_for((9, 0))
    rows = dict(t.rows)
    for mode, (push, pull1, pull2) in (("graph", graph), ("eager", eager)):
        rows[(ws, mode)] = replace(rows[(ws, mode)], push_max=push, pull1_max=pull1, pull2_max=pull2)
    return replace(t, rows=rows)


def test_push_above_its_capped_slot_stays_push_in_pieces_and_needs_no_staging():
    t = table_with(2, (64 * MB,) * 3, (64 * MB,) * 3)  # push up to 64 MB, no pull band
    push, staging, cut = size_workspace(t, 2, CustomAllReduceConfig(), graph_in_place=True)
    assert push == 16 * MB  # the slot is capped; 16..64 MB go through it in pieces
    assert staging == 4096  # no pull band: no staging beyond the P2P probe's page
    for graph in (True, False):
        assert pick_algo(16 * MB, graph, cut, 2) == Algo.PUSH_1SHOT
        assert pick_algo(32 * MB, graph, cut, 2) == Algo.PUSH_1SHOT
        assert pick_algo(128 * MB, graph, cut, 2) == Algo.NCCL


def test_staging_holds_what_the_eager_pull_bands_reach_above_push():
    t = table_with(2, (1 * MB, 1 * MB, 64 * MB), (1 * MB, 8 * MB, 32 * MB))
    push, staging, cut = size_workspace(t, 2, CustomAllReduceConfig(), graph_in_place=True)
    assert (push, staging) == (1 * MB, 32 * MB)
    assert pick_algo(4 * MB, False, cut, 2) == Algo.PULL_1SHOT and pick_algo(32 * MB, False, cut, 2) == Algo.PULL_2SHOT
    # a staging buffer smaller than the eager pull bands cuts them: larger messages fall through to NCCL
    _, _, small = size_workspace(t, 2, CustomAllReduceConfig(staging_bytes=8 * MB), graph_in_place=True)
    assert pick_algo(8 * MB, False, small, 2) == Algo.PULL_1SHOT and pick_algo(16 * MB, False, small, 2) == Algo.NCCL
    assert pick_algo(64 * MB, True, small, 2) == Algo.PULL_2SHOT  # graphs read in place


def test_no_staging_when_no_staged_pull_can_be_reached():
    t = table_with(2, (64 * MB,) * 3, (64 * MB,) * 3)
    push, staging, _ = size_workspace(t, 2, CustomAllReduceConfig(max_push_bytes=64 * MB), graph_in_place=True)
    assert (push, staging) == (64 * MB, 4096)  # the 64 MiB that could never be used is gone; a page for the probe


def test_graphs_read_in_place_so_staging_does_not_bound_them():
    t = table_with(4, (1 * MB, 1 * MB, 128 * MB), (1 * MB, 1 * MB, 32 * MB))
    push, staging, cut = size_workspace(t, 4, CustomAllReduceConfig(), graph_in_place=True)
    assert (push, staging) == (1 * MB, 32 * MB)
    assert cut.bands(4, True).pull2_max == 128 * MB and cut.bands(4, False).pull2_max == 32 * MB
    _, staging, cut = size_workspace(t, 4, CustomAllReduceConfig(), graph_in_place=False)  # graphs stage too
    assert staging == 64 * MB and cut.bands(4, True).pull2_max == 64 * MB


def test_explicit_sizes_win():
    t = table_with(2, (64 * MB,) * 3, (64 * MB,) * 3)
    cfg = CustomAllReduceConfig(push_slot_bytes=64 * MB, staging_bytes=64 * MB)
    assert size_workspace(t, 2, cfg, graph_in_place=True)[:2] == (64 * MB, 64 * MB)


def test_without_a_push_slot_the_push_band_goes_to_the_next_algorithm():
    """max_push_bytes=0 (or push_slot_bytes=0) leaves no slot, and the kernel refuses 1shot_push there ('this workspace
    has no push slot'): the table must not send anything to push, or every small all-reduce raised instead of running
    as pull (or NCCL)."""
    t = table_with(2, (1 * MB, 8 * MB, 32 * MB), (1 * MB, 8 * MB, 32 * MB))
    for cfg in (CustomAllReduceConfig(max_push_bytes=0), CustomAllReduceConfig(push_slot_bytes=0)):
        push, staging, cut = size_workspace(t, 2, cfg, graph_in_place=True)
        assert push == 0 and staging == 32 * MB
        for graph in (True, False):
            assert pick_algo(16, graph, cut, 2) == Algo.PULL_1SHOT
            assert pick_algo(1 * MB, graph, cut, 2) == Algo.PULL_1SHOT
            assert pick_algo(16 * MB, graph, cut, 2) == Algo.PULL_2SHOT
    # what push cannot hold goes to pull, as above its slot in a table with equal thresholds
    only_push = table_with(2, (64 * MB,) * 3, (64 * MB,) * 3)
    _, _, cut = size_workspace(only_push, 2, CustomAllReduceConfig(max_push_bytes=0), graph_in_place=True)
    assert pick_algo(16, False, cut, 2) == Algo.PULL_1SHOT
