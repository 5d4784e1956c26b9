"""bench/bench_engine_steps.py off the GPU: the config.json it writes reads back as the shape it names, and a point
on the built-in model times the steps that decode the whole batch."""

import dataclasses
import json

import pytest
from tpgtest.bench_modules import load_bench_module

from tpgraph.config import BUILTIN_MODEL, ModelConfig


@pytest.fixture(scope="module")
def steps():
    return load_bench_module("bench_engine_steps")


@pytest.mark.parametrize("shape", ["llama3-8b", "llama3-8b-half", "llama31-8b-half", "qwen3-8b", "qwen3-8b-half"])
def test_the_written_config_reads_back_as_the_shape(steps, shape):
    """Every field of the shape (Qwen3's head norms included) but the token ids the checkpoint names."""
    cfg = steps.SHAPES[shape]
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(steps.hf_config(cfg))))
    assert dataclasses.replace(back, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id) == cfg


def test_a_point_times_the_whole_batch_decode_steps(steps, tmp_path):
    from tpgraph import TPEngine

    (tmp_path / "config.json").write_text(json.dumps(steps.hf_config(BUILTIN_MODEL)))
    with TPEngine(str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=3, max_model_len=64,
                  num_kv_blocks=32, block_size=8) as engine:
        r = steps.run_point(engine, 3, 20, 6, "sampled+penalties", seed=1)
    # 6 tokens: the prefill's, then 5 decode steps of all 3 rows; all but the first overlap a read-back
    assert r["steps"] == 5 and r["overlapped"] >= 0.8 and r["fills"] == 3 and r["step_ms"] > 0


@pytest.mark.parametrize("mix", ["logit-bias", "one-regex"])
def test_the_step_loop_mixes_decode_the_whole_batch(steps, tmp_path, mix):
    """The mixes that time session 58's host work (a bias upload, one constrained row among free ones) run a point:
    the constrained row is not let end, so every step decodes all rows."""
    from tpgraph import TPEngine

    (tmp_path / "config.json").write_text(json.dumps(steps.hf_config(BUILTIN_MODEL)))
    with TPEngine(str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=3, max_model_len=64,
                  num_kv_blocks=32, block_size=8) as engine:
        r = steps.run_point(engine, 3, 20, 6, mix, seed=1)
    assert r["steps"] == 5 and r["step_ms"] > 0


def test_the_written_tokenizer_decodes_every_id_of_the_shapes_vocabulary(steps, tmp_path):
    """The random model samples ids across the whole vocabulary: with the built-in byte tokenizer's 258, every token
    past it was held back undecoded, and the bench understated the detokenizer's work a token."""
    from tpgraph.tokenizer import load_tokenizer

    vocab = steps.SHAPES["llama3-8b"].vocab_size
    steps.write_tokenizer(tmp_path, vocab)
    tokenizer = load_tokenizer(tmp_path, vocab)
    assert tokenizer.get_vocab_size() == vocab
    words = [tokenizer.decode([i]) for i in (259, 1000, vocab // 2, vocab - 1)]
    assert all(w.startswith(" ") and len(w) > 1 for w in words) and len(set(words)) == 4, words
    singles = {tokenizer.decode([i]) for i in range(3, 259)}  # (the 256 bytes' own symbols follow 3 specials)
    assert {chr(b) for b in range(0x20, 0x7F)} <= singles
