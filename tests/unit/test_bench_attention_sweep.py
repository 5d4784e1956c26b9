"""bench/bench_attention_sweep.py's pure parts: the points, the grid of launch shapes, the summary line."""

import pytest
from tpgtest.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def sweep():
    load_bench_module("bench_kernels")  # what the sweep imports by name, as the script finds it beside itself
    return load_bench_module("bench_attention_sweep")


@pytest.fixture(autouse=True)
def model_rules(monkeypatch):
    """The model's own launch rules: none of the settings that force them, whatever the environment exports."""
    for name in ("KV_AHEAD", "STAGES", "L2_PREFETCH", "MERGE_SPLITS", "WARPS", "PROGRAMS_PER_SM"):
        monkeypatch.delenv(f"TPGRAPH_ATTN_{name}", raising=False)


def test_points_are_batch_x_context_and_mistakes_are_named(sweep):
    assert sweep.parse_points("1x512, 32x4096") == [(1, 512), (32, 4096)]
    for bad in ("8", "8x", "0x512", "ax512", ""):
        with pytest.raises(SystemExit, match="--points"):
            sweep.parse_points(bad)


def test_the_grid_starts_with_the_default_and_scales_the_heuristics_splits(sweep):
    from tpgraph.kernels.decode_attention import choose_num_splits

    shapes = sweep.grid(32, 512, 132, [32, 64], [4], [3], [1, 2], [None, 1])
    assert shapes[0] == sweep.AttnShape()  # the model's launch, timed first
    assert len(shapes) == len(set(shapes)) == 8  # the default is also the (64, 4, 3, auto, auto) point
    doubled = [s for s in shapes if s.block_n == 32 and s.num_splits is not None]
    assert {s.num_splits for s in doubled} == {min(2 * choose_num_splits(32, 4, 512, 132, min_split_tokens=32),
                                                   512 // 32)}
    # never more splits than tiles in the context
    assert all(s.num_splits <= 2 for s in sweep.grid(1, 256, 132, [128], [4], [2], [64], [None]) if s.num_splits)


def test_the_line_names_the_best_the_default_and_the_floor(sweep):
    best = {"block_n": 32, "num_warps": 8, "num_stages": 3, "num_splits": 6, "split_tiles": 1, "us": 9.5}
    default = {**vars(sweep.AttnShape()), "us": 14.0}
    line = sweep.point_line({"batch": 32, "context": 512, "floor_us": 8.0, "best": best, "default": default,
                             "top3": [best, default], "timed": [best, default], "failed": [], "wrong": []})
    assert "best n32 w8 s3 splits 6 tiles 1 9.5 us" in line and "default 14.0 us" in line and "floor 8.0" in line
    assert "[2 timed, 0 failed, 0 wrong]" in line


def test_the_l2_prefetch_axis_resolves_auto_by_the_budget_rule(sweep, monkeypatch):
    """auto is the rule's tile count for each launch (batch 32's 384 programs: 2; batch 1's 128, 32 splits: 4); an
    explicit 0 is the default launch (timed once, as the default), and the default follows
    TPGRAPH_ATTN_L2_PREFETCH."""
    monkeypatch.delenv("TPGRAPH_ATTN_L2_PREFETCH", raising=False)
    monkeypatch.delenv("TPGRAPH_ATTN_KV_AHEAD", raising=False)
    monkeypatch.delenv("TPGRAPH_ATTN_STAGES", raising=False)
    shapes = sweep.grid(32, 8192, 132, [64], [4], [3], [1], [None], (0, "auto", 4))
    assert shapes == [sweep.AttnShape(), sweep.AttnShape(num_warps=4, num_stages=3, l2_prefetch=2),
                      sweep.AttnShape(num_warps=4, num_stages=3, l2_prefetch=4)]
    assert sweep.grid(1, 8192, 132, [64], [4], [3], [1], [None], ("auto",))[1].l2_prefetch == 4
    assert "l2 2" in shapes[1].short() and "l2" not in shapes[0].short()
    monkeypatch.setenv("TPGRAPH_ATTN_L2_PREFETCH", "1")  # the default now prefetches by the rule: auto is the default
    assert sweep.grid(32, 8192, 132, [64], [4], [3], [1], [None], (0, "auto")) == [
        sweep.AttnShape(), sweep.AttnShape(num_warps=4, num_stages=3, l2_prefetch=0)]


def test_the_read_ahead_axis_times_the_rules_choice_once(sweep, monkeypatch):
    """The rule reads ahead 1 at 3 stages at every batch (16-bit cache), so an explicit 1 at 3 stages is the default
    launch (timed once, as the default) and 0 and 2 are launches of their own; at 2 stages all three are."""
    monkeypatch.delenv("TPGRAPH_ATTN_KV_AHEAD", raising=False)
    monkeypatch.delenv("TPGRAPH_ATTN_STAGES", raising=False)
    for batch in (1, 8):
        shapes = sweep.grid(batch, 8192, 132, [64], [4], [3], [1], [None], kv_ahead=(0, 1, 2))
        assert shapes[0] == sweep.AttnShape() and [s.kv_ahead for s in shapes[1:]] == [0, 2]
    assert [s.kv_ahead for s in sweep.grid(1, 8192, 132, [64], [4], [2], [1], [None], kv_ahead=(0, 1, 2))[1:]] == [
        0, 1, 2]
    assert "ahead 2" in sweep.AttnShape(kv_ahead=2).short() and "ahead" not in sweep.AttnShape().short()


def test_the_default_follows_the_warps_setting(sweep, monkeypatch):
    """The default launch's warps are attention_warps'; an explicit 4 is that launch unless TPGRAPH_ATTN_WARPS says
    8, and then 8 is."""
    assert [s.num_warps for s in sweep.grid(1, 8192, 132, [64], [4, 8], [3], [1], [None])] == [None, 8]
    assert "w auto" in sweep.AttnShape().short() or "wauto" in sweep.AttnShape().short()
    monkeypatch.setenv("TPGRAPH_ATTN_WARPS", "8")
    assert [s.num_warps for s in sweep.grid(1, 8192, 132, [64], [4, 8], [3], [1], [None])] == [None, 4]


def test_the_merge_axes_time_the_models_settings_once(sweep, monkeypatch):
    """Long splits' cap and the merge's rows a load: the model's values (LONG_SPLIT_TILES, COMBINE_ROWS) given
    explicitly are the default launch, other values launches of their own, named in the line."""
    from tpgraph.kernels.decode_attention import COMBINE_ROWS, LONG_SPLIT_TILES

    monkeypatch.delenv("TPGRAPH_ATTN_KV_AHEAD", raising=False)
    monkeypatch.delenv("TPGRAPH_ATTN_STAGES", raising=False)
    shapes = sweep.grid(1, 32768, 132, [64], [4], [3], [1], [None], long_split_tiles=(None, LONG_SPLIT_TILES, 4),
                        combine_rows=(COMBINE_ROWS, 64))
    assert shapes[0] == sweep.AttnShape()
    assert [(s.long_split_tiles, s.combine_rows) for s in shapes[1:]] == [(None, 64), (4, COMBINE_ROWS), (4, 64)]
    assert "long 4 rows 64" in shapes[-1].short() and "long" not in sweep.AttnShape().short()
    assert sweep.auto_ints("auto,4") == (None, 4)
    merged = sweep.grid(1, 4096, 132, [64], [4], [3], [1], [None], merge_splits=(None, 16, 32))
    assert [s.merge_splits for s in merged] == [None, 16] and "merge 16" in merged[1].short()  # batch 1's rule: 32
