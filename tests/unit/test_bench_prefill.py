"""bench/bench_prefill.py off the GPU: its points parse, and a shared-prefix point finds the prefix cached from its
second run on (the first computes it), while plain points never share, not even with earlier points."""

import json

import pytest
from tpgtest.bench_modules import load_bench_module

from tpgraph.config import BUILTIN_MODEL


@pytest.fixture(scope="module")
def bench():
    return load_bench_module("bench_prefill")


def test_points_parse(bench):
    assert bench.parse_point("32x256") == (32, 256, 0)
    assert bench.parse_point("4x100+2048") == (4, 100, 2048)


def dummy_engine(bench, tmp_path):
    """The built-in model's shape on random weights, from the config.json bench_prefill writes."""
    from tpgraph import TPEngine

    (tmp_path / "config.json").write_text(json.dumps(bench.hf_config(BUILTIN_MODEL)))
    return TPEngine(str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=4, max_model_len=128,
                    num_kv_blocks=64, block_size=8)


def test_a_shared_prefix_is_computed_once(bench, tmp_path):
    with dummy_engine(bench, tmp_path) as engine:
        first = bench.run_point(engine, 3, 20, seed=0, prefix=80)
        again = bench.run_point(engine, 3, 20, seed=1, prefix=80)
        plain = bench.run_point(engine, 3, 20, seed=2)
    assert first["cached_tokens"] == 2 * 80, "the first prompt computes the prefix; the other two wait and share it"
    assert again["cached_tokens"] == 3 * 80
    assert plain["cached_tokens"] == 0 and plain["prefill_steps"] == 1


def test_plain_points_share_no_prompt_with_earlier_points(bench, tmp_path):
    with dummy_engine(bench, tmp_path) as e:
        bench.run_point(e, 1, 40, seed=1)  # main(): every point runs seeds 0 .. repeats
        later = bench.run_point(e, 2, 40, seed=1)  # the next point, e.g. 1x256 then 4x256
    assert later["cached_tokens"] == 0, f"a plain point found {later['cached_tokens']} tokens cached"
