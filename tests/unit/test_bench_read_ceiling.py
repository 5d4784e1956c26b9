"""bench/bench_read_ceiling.py off the GPU: the launch shapes cover every element once, the streaming read sums what
it reads under Triton's interpreter (what the bench checks before it times), the table picks each mode's fastest
shape, and the PDL forms wait (or not) before their first load."""

import os
from pathlib import Path

import pytest
import torch
from tpgtest.bench_modules import load_bench_module
from tpgtest.markers import interpreted


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("triton")
    return load_bench_module("bench_read_ceiling")


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 3072 * 4096, 4096 * 7168 + 3])
@pytest.mark.parametrize("per_sm", [1, 2, 4])
def test_the_programs_cover_every_element_once(bench, n, per_sm):
    config = bench.ReadConfig(per_sm, 4096, 4, 1)
    grid, chunk = bench.programs_for(n, config, sms=132)
    assert chunk % config.block == 0
    assert (grid - 1) * chunk < n <= grid * chunk  # no program starts past the end, none is missing
    assert grid <= per_sm * 132


@interpreted
@pytest.mark.parametrize("n", [1, 300, 1024, 5000])
@pytest.mark.parametrize("per_sm", [1, 4])
def test_the_read_sums_what_it_reads(bench, n, per_sm):
    src = torch.randint(-8, 8, (n,), dtype=torch.int32).to(torch.bfloat16)  # small integers: exact sums
    config = bench.ReadConfig(per_sm, 256, 4, 1)
    out = torch.full((64,), float("nan"))
    grid = bench.stream_sum(src, out, config, sms=3)
    assert grid == bench.programs_for(n, config, 3)[0]
    chunk = bench.programs_for(n, config, 3)[1]
    want = torch.stack([src[p * chunk:(p + 1) * chunk].float().sum() for p in range(grid)])
    assert torch.equal(out[:grid], want)
    bench.check_sums(out, bench.flat_sums(src.to(torch.int32), grid, chunk), "the bench's own check")
    assert out[grid:].isnan().all()  # nothing written past its programs


def test_bad_mode_and_small_out_are_refused(bench):
    config = bench.ReadConfig(1, 256, 4, 1)
    with pytest.raises(ValueError, match="mode must be one of"):
        bench.stream_sum(torch.zeros(10), torch.zeros(4), config, 3, mode="eager")
    with pytest.raises(ValueError, match="out holds 1 sums"):
        bench.stream_sum(torch.zeros(10_000, dtype=torch.bfloat16), torch.zeros(1), config, 3)


def test_the_table_takes_each_modes_fastest_shape(bench):
    row = bench.CeilingRow
    rows = [row("qkv", 1000, "read plain 1x4096x4x1", 10.0, 6.0), row("qkv", 1000, "read plain 2x4096x4x1", 8.0, 6.0),
            row("qkv", 1000, "read pdl 1x4096x4x1", 7.5, 6.0), row("qkv", 1000, "qkv (shipped small-M)", 9.0, 6.0)]
    best = bench.best_reads(rows)
    assert best[("qkv", "plain")].us == 8.0 and best[("qkv", "pdl")].us == 7.5
    text = bench.table(rows, ["plain", "pdl"], 4e12)
    assert "| qkv | 1,000 | 6.00 | 9.00, 67% | 8.00, 75% (2x4096x4x1) | 7.50, 80% (1x4096x4x1) |" in text


@pytest.mark.parametrize(("wait", "stages"), [(True, 1), (False, 3)])
def test_the_pdl_forms_wait_before_the_first_load_or_not_at_all(monkeypatch, wait, stages):
    from tpgtest.ptx import sm90_ptx

    pytest.importorskip("triton")
    bench_dir = str(Path(__file__).resolve().parents[2] / "bench")  # the compile runs in a subprocess
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [bench_dir, os.environ.get("PYTHONPATH")])))
    ptx = sm90_ptx("bench_read_ceiling", "_stream_sum", {"src": "*bf16", "out": "*fp32"}, ["n", "chunk"],
                   {"BLOCK": 4096, "STAGES": stages, "PDL": True, "WAIT": wait}, divisible=("src", "n", "chunk"))
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
    assert ptx.index("griddepcontrol.launch_dependents") < first_load
    assert ("griddepcontrol.wait" in ptx) == wait
    if wait:
        assert ptx.index("griddepcontrol.wait") < first_load
    assert ".v4" in ptx  # 16-byte loads: a streaming read, not element by element


@interpreted
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
def test_the_tile_read_sums_each_programs_tiles(bench, packed, splits):
    n, k = 32, 256
    config = bench.TileConfig(16, 64, 4, 1, splits)
    w = torch.randint(-8, 8, (n, k), dtype=torch.int32).to(torch.bfloat16)  # small integers: exact sums
    out = torch.full((16,), float("nan"))
    bench.tile_sum(w, out, config, packed, False, n, k)
    per = k // splits
    if packed:  # program (b, s)'s tiles are the next BN * per elements of the buffer
        flat = w.view(-1).float()
        want = torch.stack([flat[p * 16 * per:(p + 1) * 16 * per].sum() for p in range(2 * splits)])
    else:
        want = torch.stack([w[b * 16:(b + 1) * 16, s * per:(s + 1) * per].float().sum()
                            for b in range(2) for s in range(splits)])
    assert torch.equal(out[:2 * splits], want)
    assert out[2 * splits:].isnan().all()


def test_tiles_that_do_not_divide_the_weight_are_refused(bench):
    with pytest.raises(ValueError, match="do not divide a 40x256 weight"):
        bench.tile_sum(torch.zeros(40, 256), torch.zeros(8), bench.TileConfig(16, 64, 4, 1, 1), False, False, 40, 256)
    with pytest.raises(ValueError, match="do not divide a 32x256 weight"):
        bench.tile_sum(torch.zeros(32, 256), torch.zeros(8), bench.TileConfig(16, 64, 4, 1, 3), False, False, 32, 256)


def test_the_tiles_table_sets_each_form_beside_the_shipped_kernel(bench):
    row = bench.CeilingRow
    rows = [row("qkv", 1000, "tiles rows 32x128x4x3x4", 8.0, 6.0),
            row("qkv", 1000, "tiles packed 32x128x4x3x4", 7.5, 6.0),
            row("qkv", 1000, "qkv (shipped small-M)", 9.0, 6.0)]
    assert "| qkv | 32x128x4x3x4 | 8.00, 75% | 7.50, 80% | 9.00, 67% |" in bench.tiles_table(rows)


@interpreted
@pytest.mark.parametrize("splits", [1, 2])
def test_the_dot_form_sums_the_products_of_the_one_row(bench, splits):
    n, k = 32, 256
    config = bench.TileConfig(16, 64, 4, 1, splits)
    # fp32 (the interpreter has no bf16 dot); small integers: exact products and sums
    w = torch.randint(-8, 8, (n, k), dtype=torch.int32).float()
    x = torch.randint(-4, 4, (1, k), dtype=torch.int32).float()
    out = torch.full((16,), float("nan"))
    bench.tile_sum(w, out, config, False, False, n, k, x=x)
    per = k // splits
    want = torch.stack([(w[b * 16:(b + 1) * 16, s * per:(s + 1) * per].float()
                         @ x[0, s * per:(s + 1) * per].float()).sum() for b in range(2) for s in range(splits)])
    assert torch.equal(out[:2 * splits], want)


def test_the_steps_table_lists_the_path_from_the_read_to_the_kernel(bench):
    row = bench.CeilingRow
    # in the order measure_size makes them: the shipped kernel before the dot
    rows = [row("qkv", 1000, "read pdl 4x4096x4x3", 7.0, 6.0), row("qkv", 1000, "tiles rows 32x128x4x3x4", 7.3, 6.0),
            row("qkv", 1000, "qkv (shipped small-M)", 9.6, 6.0), row("qkv", 1000, "tiles dot 32x128x4x3x4", 7.5, 6.0),
            row("qkv", 1000, "gemv ablate: partials not added", 8.0, 6.0)]
    text = bench.steps_table(rows)
    assert "read pdl" not in text
    assert "| qkv | tiles dot 32x128x4x3x4 | 7.50 | 80% |" in text
    assert "| qkv | gemv ablate: partials not added | 8.00 | 75% |" in text
    assert text.index("tiles rows") < text.index("tiles dot") < text.index("shipped") < text.index("ablate")


@pytest.mark.parametrize("packed", [False, True])
def test_the_expected_tile_sums_follow_the_programs(bench, packed):
    """tile_sums (what the bench checks each launch against) for a weight whose elements are their own index."""
    w = torch.arange(8 * 12).view(8, 12)
    config = bench.TileConfig(4, 2, 4, 1, 3)  # 2 column blocks x 3 splits of 4 columns
    got = bench.tile_sums(w, config, packed)
    if packed:
        want = [w.reshape(-1)[p * 16:(p + 1) * 16].sum() for p in range(6)]
    else:
        want = [w[b * 4:(b + 1) * 4, s * 4:(s + 1) * 4].sum() for b in range(2) for s in range(3)]
    assert got.tolist() == [int(v) for v in want]


def test_a_launch_that_stored_another_sum_is_caught(bench):
    out = torch.tensor([3.0, 5.0, float("nan")])
    bench.check_sums(out, torch.tensor([3, 5]), "ok")
    for bad in ([3.0, 4.0], [float("nan"), 5.0]):
        with pytest.raises(AssertionError, match="1 of 2 programs stored another sum"):
            bench.check_sums(torch.tensor(bad), torch.tensor([3, 5]), "bad")
