"""Grid choice and launch bands for tpgraph-tune."""

from tpgraph.tune.launch import grid_spec, launch_bands, smallest_near_best

MB = 1 << 20


def test_the_smallest_grid_within_2_percent_of_the_fastest():
    assert smallest_near_best({1: 2.6, 2: 2.55, 132: 4.8}) == 1  # 2 is fastest, 1 within 2%
    assert smallest_near_best({1: 20.0, 64: 7.0, 132: 6.0}) == 132


def test_launch_bands_merge_equal_neighbours_and_name_sm_multiples():
    assert launch_bands({8192: 1, 65536: 1, MB: 132, 8 * MB: 132, 64 * MB: 264}, 132) == [
        [65536, 1], [8 * MB, "num_sms"], [64 * MB, "num_sms*2"]]


def test_grid_spec_names_sm_multiples():
    assert grid_spec(132, 132) == "num_sms"
    assert grid_spec(264, 132) == "num_sms*2"
    assert grid_spec(96, 132) == 96


def test_every_grid_tried_is_the_grid_the_written_table_then_launches():
    """The tuner times a grid, writes it as the table's launch band, and the product resolves that band: it must
    launch the grid that was timed. An integer grid above the SM count resolves to the SM count (the table's rule),
    so on a GPU of fewer than 64 SMs (an L4's 58) a timed 64 was written, and 58 blocks ran instead."""
    import json

    from tpgraph.comm.thresholds import Algo, config_dir, parse_table
    from tpgraph.tune.measure import CUSTOM, grids_for
    from tpgraph.tune.writer import updated_table

    doc = json.loads((config_dir() / "allreduce" / "other.json").read_text())
    rows = {mode: {"push_max": 64 * MB, "pull1_max": 64 * MB, "pull2_max": 64 * MB} for mode in ("graph", "eager")}
    for num_sms in (16, 40, 58, 64, 78, 132, 148):
        for algo in CUSTOM:
            for blocks in grids_for(algo, 64 * MB, 2, num_sms):
                launch = {algo: launch_bands({64 * MB: blocks}, num_sms)}
                table = parse_table(updated_table(doc, 2, rows, "x", launch), "t")
                assert table.blocks(Algo(algo), 2, num_sms, 64 * MB) == blocks, (num_sms, algo, blocks)
