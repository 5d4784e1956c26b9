"""bench/decode_host_breakdown.py on CPU: a breakable runner keeps the whole host path of a graph step (dispatch,
stats, input writes, the one commit, replay), so the breakdown runs here and its parts must add up."""

import sys
from pathlib import Path

import pytest
from tpgtest.bench_modules import load_bench_module

from tpgraph.comm import TPCommunicator
from tpgraph.distributed import init_distributed
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.graphs.config import GraphConfig
from tpgraph.model.loader import load_model


@pytest.fixture(scope="module")
def breakdown_module():
    bench_dir = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench_dir)  # the script imports its sibling bench_decode
    try:
        yield load_bench_module("decode_host_breakdown")
    finally:
        sys.path.remove(bench_dir)


def test_breakdown_parts_add_up_and_blocks_come_back(breakdown_module):
    state = init_distributed("cpu")
    model = load_model(state, TPCommunicator(state))
    graphs = GraphConfig(decode_mode="breakable", prefill_mode="none", ladder=(1, 2, 4, 8))
    runner = ModelRunner(model, RunnerConfig(block_size=16, max_batch=8, max_model_len=128, graphs=graphs))
    free = runner.allocator.num_free
    row = breakdown_module.breakdown(runner, 3, 20, 4, "tolist")
    parts = ("null", "dispatch", "stats", "write", "commit", "replay", "sync")
    assert set(row) == {*parts, "wall"}  # no GPU: no graph-alone timings
    assert all(row[k] >= 0 for k in parts)
    assert sum(row[k] for k in parts) == pytest.approx(row["wall"], rel=0.5)  # medians of parts vs median of sums
    assert ("decode", "breakable", 3, 4, 7) in runner.stats.frequency_table()  # 4 timed + 3 warm-up steps
    assert runner.allocator.num_free == free
    runner.close()
