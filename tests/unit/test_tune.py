from tpgraph.comm.tune import derive_bands, winners

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
