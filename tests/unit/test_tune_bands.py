"""tpgraph-tune's band derivation from synthetic curves, and the table writer."""

import json
import random

import pytest

from tpgraph.comm.thresholds import Algo, load_table, parse_table, pick_algo
from tpgraph.errors import ConfigError
from tpgraph.tune.bands import Curves, derive_bands
from tpgraph.tune.writer import diff, render, updated_table

SIZES = tuple(4096 << i for i in range(15))  # 4 KB .. 64 MB


def curves(push, pull1, pull2, nccl, sizes=SIZES):
    return Curves(sizes, {"1shot_push": push, "1shot_pull": pull1, "2shot_pull": pull2, "nccl": nccl})


def clean():
    """push wins to 64 KB, pull1 to 1 MB, pull2 to 16 MB, NCCL at 32 and 64 MB (the winner 10 µs, the rest 20)."""
    winner = ["1shot_push"] * 5 + ["1shot_pull"] * 4 + ["2shot_pull"] * 4 + ["nccl"] * 2
    return tuple([10.0 if w == algo else 20.0 for w in winner]
                 for algo in ("1shot_push", "1shot_pull", "2shot_pull", "nccl"))


def test_clean_curves_give_the_crossings():
    choice = derive_bands(curves(*clean()), tolerance=0.0)
    assert choice.bounds == {"push_max": 65536, "pull1_max": 1 << 20, "pull2_max": 16 << 20}
    assert choice.excess == 0
    assert choice.owner[-1] == "nccl"


def test_noise_cannot_open_a_one_point_band():
    rng = random.Random(0)
    push, pull1, pull2, nccl = (list(c) for c in clean())
    pull1[1] = push[1] * 0.9  # a flip at 8 KB, inside push's range
    jitter = [[t * (1 + rng.uniform(-0.01, 0.01)) for t in c] for c in (push, pull1, pull2, nccl)]
    choice = derive_bands(curves(*jitter))
    assert choice.bounds["push_max"] == 65536  # the 8 KB flip did not split push's band
    runs = [a for i, a in enumerate(choice.owner) if i == 0 or choice.owner[i - 1] != a]
    assert runs == ["1shot_push", "1shot_pull", "2shot_pull", "nccl"]


def test_an_algorithm_that_never_wins_gets_an_empty_band():
    push, pull1, pull2, nccl = clean()
    pull1 = [t * 3 for t in pull1]
    choice = derive_bands(curves(push, pull1, pull2, nccl), tolerance=0.0)
    assert "1shot_pull" not in choice.owner
    assert choice.bounds["pull1_max"] == choice.bounds["push_max"]  # equal bounds: the band holds nothing
    table = _table_with(choice.bounds)
    assert all(pick_algo(s, True, table, 2) != Algo.PULL_1SHOT for s in SIZES)


def test_crossings_that_reverse_get_the_least_loss():
    # pull1 beats push at 16-32 KB, push wins again at 64-128 KB: monotone bands cannot follow it
    push = [10.0] * 6 + [50.0] * 9
    pull1 = [11.0, 11.0, 9.0, 9.0, 11.0, 11.0] + [20.0] * 9
    pull2 = [40.0] * 15
    nccl = [100.0] * 15
    choice = derive_bands(curves(push, pull1, pull2, nccl), tolerance=0.0)
    # push up to 128 KB would lose 2 x 11% at 16-32 KB; pull1 from 16 KB loses 2 x 10% at 64-128 KB: the least loss
    assert choice.bounds["push_max"] == SIZES[1]
    assert choice.excess == pytest.approx(2 * (11 / 10 - 1))
    assert choice.owner[2:] == ("1shot_pull",) * 13


def test_of_two_algorithms_within_the_tolerance_the_faster_gets_the_band():
    # measured on 2xH200 (tune run1): above the push slot, 1shot_pull within 2% of 2shot_pull at 32 and 64 MB; either
    # band costs nothing beyond a 3% tolerance and opens one band, so the faster must win the tie
    push = [10.0] * 13 + [None, None]
    pull1 = [20.0] * 13 + [109.3, 209.4]
    pull2 = [20.0] * 13 + [107.0, 206.1]
    nccl = [30.0] * 13 + [152.3, 265.0]
    choice = derive_bands(curves(push, pull1, pull2, nccl), tolerance=0.03)
    assert choice.excess == 0
    assert choice.owner[-2:] == ("2shot_pull", "2shot_pull")
    assert choice.bounds == {"push_max": SIZES[12], "pull1_max": SIZES[12], "pull2_max": SIZES[14]}


def test_the_default_grid_resolves_a_crossing_inside_an_octave():
    # tune run 2026-11-30 (session 5), eager, above the 16 MiB push slot: 1shot_pull 5% ahead of NCCL at 32 MB, 8%
    # behind at 64 MB. On powers of two alone 32 MB is a one-point band and goes to NCCL; the default grid's
    # midpoints give 1shot_pull two sizes (24 and 32 MB), so it keeps them.
    from tpgraph.tune.measure import DEFAULT_SIZES

    assert all(s % 16 == 0 for s in DEFAULT_SIZES) and list(DEFAULT_SIZES) == sorted(set(DEFAULT_SIZES))
    assert {24 << 20, 48 << 20} <= set(DEFAULT_SIZES) and DEFAULT_SIZES[-1] == 64 << 20
    above = {24 << 20: (98.0, 110.0, 104.0), 32 << 20: (131.7, 144.1, 138.3), 48 << 20: (203.0, 215.0, 196.0),
             64 << 20: (267.5, 282.4, 248.4)}  # (1shot_pull, 2shot_pull, NCCL)

    def grid(sizes):
        push = [10.0 if s <= 16 << 20 else None for s in sizes]  # the push slot
        pull1, pull2, nccl = ([above[s][k] if s in above else 20.0 + 10 * k for s in sizes] for k in range(3))
        return curves(push, pull1, pull2, nccl, sizes=tuple(sizes))

    owner = dict(zip(DEFAULT_SIZES, derive_bands(grid(DEFAULT_SIZES)).owner, strict=True))
    assert owner[24 << 20] == owner[32 << 20] == "1shot_pull" and owner[64 << 20] == "nccl"
    octaves = [s for s in DEFAULT_SIZES if s & (s - 1) == 0]
    assert dict(zip(octaves, derive_bands(grid(octaves)).owner, strict=True))[32 << 20] == "nccl"


def test_an_unmeasured_algorithm_gets_no_size():
    push, pull1, pull2, nccl = clean()
    choice = derive_bands(Curves(SIZES, {"1shot_push": push, "nccl": nccl, "2shot_pull": pull2}), tolerance=0.0)
    assert "1shot_pull" not in choice.owner and choice.bounds["pull1_max"] == choice.bounds["push_max"]


def test_curves_are_checked():
    with pytest.raises(ValueError, match="NCCL must be measured"):
        Curves(SIZES, {"1shot_push": [1.0] * 15})
    with pytest.raises(ValueError, match="ascending"):
        Curves((8, 4), {"nccl": [1.0, 1.0]})


def _table_with(bounds):
    doc = _doc()
    doc = updated_table(doc, 2, {"graph": bounds, "eager": bounds}, "synthetic")
    return parse_table(doc, "synthetic")


def _doc():
    from tpgraph.comm.thresholds import config_dir

    return json.loads((config_dir() / "allreduce" / "sm90.json").read_text())


def test_the_writer_keeps_other_rows_and_round_trips(tmp_path):
    doc = _doc()
    bounds = {"graph": {"push_max": 65536, "pull1_max": 1 << 20, "pull2_max": 16 << 20},
              "eager": {"push_max": 32768, "pull1_max": 1 << 20, "pull2_max": 8 << 20}}
    launch = {Algo.PUSH_1SHOT: [[8192, 2], [67108864, "num_sms"]]}
    new = updated_table(doc, 2, bounds, "GPU X; 2026-11-30; tpgraph-tune", launch)
    untouched = [r for r in doc["rows"] if r["world_size"] != 2]
    assert [r for r in new["rows"] if r["world_size"] != 2] == untouched
    for mode in ("graph", "eager"):
        row = next(r for r in new["rows"] if r["world_size"] == 2 and r["mode"] == mode)
        assert {k: row[k] for k in bounds[mode]} == bounds[mode] and "tpgraph-tune" in row["provenance"]
    assert new["launch"]["push_blocks"]["2"] == [[8192, 2], [67108864, "num_sms"]]
    others = {k: v for k, v in doc["launch"]["push_blocks"].items() if k != "2"}
    assert {k: v for k, v in new["launch"]["push_blocks"].items() if k != "2"} == others
    path = tmp_path / "sm90.json"
    path.write_text(render(new))
    table = load_table(path)
    assert table.bands(2, True).push_max == 65536 and table.bands(2, False).pull2_max == 8 << 20
    assert "push_max" in diff(tmp_path / "old.json", render(new))  # a missing file diffs as all new


def test_the_writer_leaves_sm100_alone(tmp_path):
    from tpgraph.comm.thresholds import config_dir

    sm100 = (config_dir() / "allreduce" / "sm100.json").read_text()
    updated_table(_doc(), 2, {"graph": {"push_max": 16, "pull1_max": 16, "pull2_max": 16}}, "x")
    assert (config_dir() / "allreduce" / "sm100.json").read_text() == sm100  # nothing written but the target


@pytest.mark.parametrize("ws", [1, 9, 0])
def test_the_writer_refuses_world_sizes_outside_2_to_8(ws):
    with pytest.raises(ConfigError, match="outside 2..8"):
        updated_table(_doc(), ws, {"graph": {"push_max": 16, "pull1_max": 16, "pull2_max": 16}}, "x")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_figure_that_is_not_a_time_counts_as_not_measured(bad):
    # a zero best divided every other figure by zero (the run's bands lost to a ZeroDivisionError); a negative one
    # made every other algorithm look as fast as it; each must be what NaN already was: that size not measured
    push, pull1, pull2, nccl = (list(c) for c in clean())
    unmeasured = derive_bands(curves([None, *push[1:]], pull1, pull2, nccl), tolerance=0.0)
    assert derive_bands(curves([bad, *push[1:]], pull1, pull2, nccl), tolerance=0.0) == unmeasured


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), 0.0])
def test_a_size_no_algorithm_has_a_time_at_is_refused(bad):
    # every assignment then cost inf, so the fewest bands won: 1shot_push for every size, whatever the others showed
    push, pull1, pull2, nccl = (list(c) for c in clean())
    for c in (push, pull1, pull2, nccl):
        c[7] = bad
    with pytest.raises(ValueError, match=f"no algorithm has a time at {SIZES[7]} bytes"):
        curves(push, pull1, pull2, nccl)
