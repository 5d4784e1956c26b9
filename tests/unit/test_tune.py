from tpgraph.comm.tune import derive_bands, derive_launch, grid_spec, winners

MB = 1 << 20


def row(n, push=None, pull1=None, pull2=None, nccl=100.0, eager_shift=0.0):
    r = {"bytes": n, "nccl_graph_us": nccl}
    for name, t in (("1shot_push", push), ("1shot_pull", pull1), ("2shot_pull", pull2)):
        if t is not None:
            r[f"{name}_graph_us"] = t
            r[f"{name}_eager_device_us"] = t + eager_shift
    return r


def test_bands_follow_the_winners_in_order():
    rows = [row(1 * MB, 5, 7, 8), row(2 * MB, 10, 9, 12), row(4 * MB, 30, 25, 20), row(8 * MB, 90, 80, 70, nccl=60)]
    assert [w for _, w in winners(rows, "graph")] == ["1shot_push", "1shot_pull", "2shot_pull", "nccl"]
    assert derive_bands(rows, "graph", 128 * MB) == {"push_max": 1 * MB, "pull1_max": 2 * MB, "pull2_max": 4 * MB}


def test_a_band_that_never_wins_is_disabled_and_the_last_extends():
    rows = [row(1 * MB, 5, 7, 8), row(8 * MB, 40, 45, 35), row(64 * MB, 400, 220, 230, nccl=1000)]
    # at 64 MB 1shot_pull wins but comes before 2shot_pull: folded into 2shot's band, which reaches the ceiling
    assert derive_bands(rows, "graph", 128 * MB) == {"push_max": 1 * MB, "pull1_max": 1 * MB, "pull2_max": 128 * MB}


def test_eager_uses_device_time():
    rows = [row(1 * MB, 5, 7, 8, nccl=10, eager_shift=6)]  # eager push 11 > NCCL 10
    assert derive_bands(rows, "eager", 128 * MB) == {"push_max": 0, "pull1_max": 0, "pull2_max": 0}
    assert derive_bands(rows, "graph", 128 * MB)["push_max"] == 128 * MB


def sweep_entry(n, algo, times):
    return {"bytes": n, "algo": algo, "us_by_blocks": {str(b): t for b, t in times.items()}}  # JSON keys


def test_launch_bands_take_the_smallest_near_best_grid_and_merge():
    sweep = [sweep_entry(8192, "1shot_push", {1: 2.6, 2: 2.55, 132: 4.8}),  # 2 is best, 1 is within 2%
             sweep_entry(1 * MB, "1shot_push", {1: 20.0, 64: 7.0, 132: 6.0}),
             sweep_entry(8 * MB, "1shot_push", {64: 40.0, 132: 30.0}),
             sweep_entry(8 * MB, "2shot_pull", {32: 31.5, 64: 30.6, 132: 30.8})]
    launch = derive_launch(sweep, 132)
    assert launch["push_blocks"] == [[8192, 1], [8 * MB, "num_sms"]]
    assert launch["pull2_blocks"] == [[8 * MB, 64]]
    assert "pull1_blocks" not in launch


def test_grid_spec_names_sm_multiples():
    assert grid_spec(132, 132) == "num_sms"
    assert grid_spec(264, 132) == "num_sms*2"
    assert grid_spec(96, 132) == 96
