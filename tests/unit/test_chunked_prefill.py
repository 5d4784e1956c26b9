"""A prompt prefilled in chunks (each chunk attending to the cached ones before it) gives what one prefill gives."""

import pytest
import torch

from tpgraph.comm import TPCommunicator
from tpgraph.distributed import init_distributed
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import ConfigError
from tpgraph.graphs.config import GraphConfig
from tpgraph.model.loader import load_model

PROMPT = [256, *range(40, 63)]  # 24 tokens, block size 4


@pytest.fixture(scope="module")
def model():
    state = init_distributed("cpu")
    return load_model(state, TPCommunicator(state))


def make_runner(model, prefill_mode="none"):
    graphs = GraphConfig(decode_mode="none", prefill_mode=prefill_mode, ladder=(1, 2))
    return ModelRunner(model, RunnerConfig(block_size=4, max_batch=2, max_model_len=64, num_kv_blocks=40,
                                           graphs=graphs))


def decode_tokens(runner, seq, logits, steps=5):
    out = []
    for _ in range(steps):
        tok = int(logits[-1].argmax())
        out.append(tok)
        seq.output_ids.append(tok)
        logits = runner.decode([seq])
    return out


@pytest.mark.parametrize("chunks", [[7, 8, 9], [1, 23], [4, 4, 4, 4, 4, 4], [23, 1]])
def test_chunks_equal_one_prefill(model, chunks):
    runner = make_runner(model)
    whole = Sequence(0, list(PROMPT), 8)
    whole_logits = runner.prefill([whole])
    expected = decode_tokens(runner, whole, whole_logits)
    runner.free(whole)

    seq = Sequence(1, list(PROMPT), 8)
    for n in chunks:
        logits = runner.prefill([seq], [n])
    assert seq.num_cached == len(PROMPT)
    torch.testing.assert_close(logits, whole_logits, rtol=1e-5, atol=1e-5)
    assert decode_tokens(runner, seq, logits) == expected
    runner.free(seq)


def test_a_batch_mixing_fresh_and_continued_sequences(model):
    runner = make_runner(model)
    ref = [Sequence(i, list(PROMPT[: 10 + 5 * i]), 8) for i in range(2)]
    ref_logits = runner.prefill(ref)
    for s in ref:
        runner.free(s)
    a, b = (Sequence(i, list(PROMPT[: 10 + 5 * i]), 8) for i in range(2))
    runner.prefill([a], [6])  # a is half cached, b fresh
    logits = runner.prefill([a, b], [4, 15])
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_bad_chunk_sizes_are_refused(model):
    runner = make_runner(model)
    seq = Sequence(0, list(PROMPT), 8)
    with pytest.raises(ConfigError, match="cannot prefill 25 tokens"):
        runner.prefill([seq], [25])
    with pytest.raises(ConfigError, match="cannot prefill 0 tokens"):
        runner.prefill([seq], [0])
    with pytest.raises(ConfigError, match="2 token counts for 1 sequences"):
        runner.prefill([seq], [1, 2])
