"""The rope cos/sin tables are sized by the max_model_len the engine runs with, not the model's whole context."""

import pytest
import torch

from tpgraph.comm import TPCommunicator
from tpgraph.config import BUILTIN_MODEL
from tpgraph.distributed import init_distributed
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.memory import MemoryBudget
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.model.loader import load_model
from tpgraph.model.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def state():
    return init_distributed("cpu")


def _runner(state, **cfg) -> ModelRunner:
    return ModelRunner(load_model(state, TPCommunicator(state)), RunnerConfig(block_size=4, max_batch=2, **cfg))


def test_tables_have_a_row_per_position_of_max_model_len(state):
    runner = _runner(state, max_model_len=32, num_kv_blocks=20)
    assert runner.model.rotary.cos.shape[0] == runner.model.rotary.sin.shape[0] == 32


def test_default_max_model_len_capped_by_the_cache_sizes_the_tables(state):
    runner = _runner(state, num_kv_blocks=12)  # the model's 4096 tokens, capped to the 11 blocks' 44
    assert runner.max_model_len == 44 and runner.model.rotary.cos.shape[0] == 44


def test_model_built_for_max_positions_never_makes_the_whole_context(state):
    model = load_model(state, TPCommunicator(state), max_positions=64)
    assert model.rotary.cos.shape[0] == 64 < BUILTIN_MODEL.max_context


def test_rows_are_those_of_the_whole_table(state):
    whole = RotaryEmbedding(BUILTIN_MODEL.head_dim, BUILTIN_MODEL.rope, BUILTIN_MODEL.max_context, torch.bfloat16,
                            torch.device("cpu"))
    small = RotaryEmbedding(BUILTIN_MODEL.head_dim, BUILTIN_MODEL.rope, 4096, torch.bfloat16, torch.device("cpu"))
    small.resize(100)
    assert torch.equal(small.cos, whole.cos[:100]) and torch.equal(small.sin, whole.sin[:100])


def test_outputs_do_not_depend_on_the_table_size(state):
    prompts = [[256, 72, 105, 33], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    short = greedy_generate(_runner(state, max_model_len=32, num_kv_blocks=20), prompts, 16).tokens
    long = greedy_generate(_runner(state, max_model_len=1024, num_kv_blocks=600), prompts, 16).tokens
    assert short == long


def test_budget_names_the_rope_tables():
    budget = MemoryBudget(total=1 << 34, utilization=0.9, in_use=1 << 30, weights=1 << 29, workspace=0,
                          activation_peak=0, graph_pool_estimate=0, block_bytes=1 << 20, rope_tables=3 << 20)
    assert "rope tables 3.00 MiB" in budget.describe()
