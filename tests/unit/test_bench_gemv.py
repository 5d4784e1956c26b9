"""bench/bench_gemv.py's pure part: the config grid its --sweep times."""


import pytest
from tpgtest.bench_modules import load_bench_module

SMS = 132  # H200


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("triton")
    return load_bench_module("bench_gemv")  # (it imports bench_decode: load_bench_module puts bench/ on the path)


def test_split_k_only_where_column_blocks_leave_sms_idle(bench):
    for n, k in bench.SHAPES.values():
        grid = bench.sweep_configs(n, k, SMS)
        assert len(grid) == len(set(grid)) <= bench.MAX_TIMED
        assert all(-(-n // c.block_n) < 2 * SMS for c in grid if c.split_k > 1)
        assert {c.split_k for c in grid if c.block_n == 64} == ({1} if -(-n // 64) >= 2 * SMS else {1, 2, 4})
    assert {c.split_k for c in bench.sweep_configs(64128, 4096, SMS)} == {1}  # lm_head: 1002 column blocks
    assert len(bench.sweep_configs(3072, 4096, SMS)) == 108  # 36 tiles x 3 splits
    wide = bench.sweep_configs(3072, 4096, SMS, (1, 2, 4, 8, 16))  # 512-wide K tiles take at most 8 splits of 4096
    assert len(wide) == 36 * 5 - 12 and len(wide) <= bench.MAX_TIMED and {c.split_k for c in wide} == {1, 2, 4, 8, 16}


def test_no_split_has_an_empty_k_range(bench):
    assert all(c.split_k <= -(-1024 // c.block_k) for c in bench.sweep_configs(1024, 1024, SMS))
