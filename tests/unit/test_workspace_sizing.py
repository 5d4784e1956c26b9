"""How much workspace the custom all-reduce takes: a capped push slot, staging only for what a staged pull can get,
and the table cut to both (larger messages fall through to the next algorithm)."""

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


def test_push_everywhere_is_capped_and_falls_through_to_1shot_pull():
    t = table_with(2, (64 * MB,) * 3, (64 * MB,) * 3)  # push up to 64 MB, no pull band
    push, staging, cut = size_workspace(t, 2, CustomAllReduceConfig(), graph_in_place=True)
    assert push == 16 * MB
    assert staging == 64 * MB  # eager 16..64 MB now goes to 1shot_pull, which stages its input
    for graph in (True, False):
        assert pick_algo(16 * MB, graph, cut, 2) == Algo.PUSH_1SHOT
        assert pick_algo(32 * MB, graph, cut, 2) == Algo.PULL_1SHOT
        assert pick_algo(128 * MB, graph, cut, 2) == Algo.NCCL


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
