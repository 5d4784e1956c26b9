import subprocess
import sys

import pytest

from tpgraph._ext import extension_available, load_ext
from tpgraph.comm import TPCommunicator
from tpgraph.distributed import init_distributed
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.kv_cache import BlockAllocator, OutOfBlocks
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.errors import ConfigError, ExtensionError
from tpgraph.model.loader import load_model
from tpgraph.tokenizer import builtin_tokenizer


def test_block_allocator():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(OutOfBlocks, match="need 2 KV blocks, 1 free of 4"):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4


def test_byte_tokenizer_roundtrip():
    tok = builtin_tokenizer()
    text = "héllo, wörld — 你好 \n\t!"
    ids = tok.encode(text).ids
    assert ids[0] == 256 and all(i < 256 for i in ids[1:])
    assert ids[1:] == list(text.encode())
    assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def runner():
    state = init_distributed("cpu")
    model = load_model(state, TPCommunicator(state))
    return ModelRunner(model, RunnerConfig(block_size=4, max_batch=2, max_model_len=32, num_kv_blocks=12))


def test_prompt_too_long_is_rejected(runner):
    with pytest.raises(ConfigError, match="exceeds max_model_len 32"):
        greedy_generate(runner, [[1] * 30], 4)
    assert runner.allocator.num_free == 11  # 12 blocks, one of them the reserved null block


def test_empty_prompt_and_batch_limits(runner):
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        greedy_generate(runner, [[]], 4)
    with pytest.raises(ConfigError, match="exceed max_batch"):
        greedy_generate(runner, [[1], [2], [3]], 4)


def test_batched_equals_one_by_one(runner):
    """Paging and batching do not change results: a batch of two equals each prompt alone."""
    a, b = [256, 72, 105], [256, 1, 2, 3, 4, 5, 6, 7, 8]
    both = greedy_generate(runner, [a, b], 10).tokens
    assert both == [greedy_generate(runner, [a], 10).tokens[0], greedy_generate(runner, [b], 10).tokens[0]]
    assert runner.allocator.num_free == 11


def test_extension_error_names_the_fix():
    if extension_available():
        assert load_ext().build_info().archs
        return
    with pytest.raises(ExtensionError, match="pip install --no-build-isolation -e ."):
        load_ext()


def test_generate_cli_builtin_model():
    proc = subprocess.run([sys.executable, "-m", "tpgraph.generate", "--prompt", "Hello", "--max-tokens", "5",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "completion:" in proc.stdout and "5 tokens" in proc.stdout
    assert "CUDA GRAPH MODE DOWNGRADED" in proc.stderr and "decode: full -> none" in proc.stderr  # loud, on CPU


def test_generate_cli_graph_flags():
    proc = subprocess.run([sys.executable, "-m", "tpgraph.generate", "--prompt", "Hello", "--prompt", "Hi there",
                           "--prompt", "x", "--max-tokens", "4", "--device", "cpu", "--cuda-graph-mode", "breakable",
                           "--cuda-graph-ladder", "1,4", "--max-num-seqs", "4", "--prefill-graph-mode", "none",
                           "--check-graph-addresses"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "decode graphs        breakable: [1, 4]" in proc.stderr  # the start-up summary
    assert "decode   breakable         3       4      3" in proc.stdout  # 3 sequences padded to the 4 bucket
    bad = subprocess.run([sys.executable, "-m", "tpgraph.generate", "--prompt", "x", "--device", "cpu",
                          "--cuda-graph-ladder", "1,0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "ladder" in bad.stderr


def test_dummy_load_format_needs_only_config(tmp_path):
    import json

    from tpgraph.config import BUILTIN_MODEL

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    state = init_distributed("cpu")
    model = load_model(state, TPCommunicator(state), tmp_path, load_format="dummy")
    assert model.cfg.vocab_size == 300 and model.cfg != BUILTIN_MODEL
    assert model.layers[0].mlp.down_proj.weight.abs().sum() > 0  # filled, not left at zero
    with pytest.raises(ConfigError, match="load_format must be one of"):
        load_model(state, TPCommunicator(state), tmp_path, load_format="gguf")


def test_decode_block_tables_are_moved_and_extended_not_rewritten(monkeypatch):
    """A decode row's block table is written from the host's list once; when its sequence moves to another row (one
    before it finished, or sat out a step) the row is copied over, and a grown table gets its new entries alone. Each
    shift of the batch rewrote every moved row's whole table from its list: O(batch x context) Python work in the
    step, 2.7 ms at 256 rows of 4000 tokens."""
    from tpgraph.engine.sequence import Sequence

    state = init_distributed("cpu")
    model = load_model(state, TPCommunicator(state))
    r = ModelRunner(model, RunnerConfig(block_size=4, max_batch=4, max_model_len=64, num_kv_blocks=80))
    seqs = [Sequence(i, [1] * 39, 8, output_ids=[2], block_table=list(range(10 * i + 1, 10 * i + 11)), num_cached=39)
            for i in range(5)]
    written = []
    real = ModelRunner._write_table_row
    monkeypatch.setattr(r, "_write_table_row",
                        lambda tables, row, table, start: written.append(len(table) - start)
                        or real(tables, row, table, start))
    tables = r.decode_in.host_np("block_tables")

    def check(batch):
        r._write_decode_inputs(batch)
        for i, seq in enumerate(batch):
            assert list(tables[i, :len(seq.block_table)]) == seq.block_table

    check(seqs[:4])
    assert sum(written) == 40  # (every table once, whole)
    written.clear()
    check(seqs[1:5])  # the first finished: three move up a row, one arrives
    assert sum(written) == 10
    written.clear()
    check([seqs[4], seqs[2], seqs[1], seqs[3]])  # every row changes hands
    assert sum(written) == 0
    written.clear()
    seqs[2].output_ids.append(3)  # a new block
    check([seqs[2], seqs[4], seqs[1], seqs[3]])
    assert sum(written) == 1
    written.clear()
    seqs[1].num_preemptions += 1  # preempted and back with other blocks: written whole
    seqs[1].block_table = list(range(61, 71))
    check([seqs[2], seqs[4], seqs[1], seqs[3]])
    assert sum(written) == 10
