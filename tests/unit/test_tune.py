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
