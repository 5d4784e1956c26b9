"""Sharding arithmetic, slice-only reads, and loader errors (single process: no collectives needed)."""

import pytest
import torch
from tpgtest.hf_fixtures import make_checkpoint

from tpgraph.comm import TPCommunicator
from tpgraph.config import BUILTIN_MODEL, ModelConfig
from tpgraph.distributed import ParallelState
from tpgraph.errors import CheckpointError, ConfigError
from tpgraph.model.layers import VocabShard
from tpgraph.model.llama import LlamaForCausalLM, kv_head_split
from tpgraph.model.loader import RandomSource, SafetensorsSource, load_weights
from tpgraph.model.rotary import inv_frequencies


def fake_rank(rank: int, world: int) -> TPCommunicator:
    """A communicator for building one rank's shard in-process (loading does no communication)."""
    return TPCommunicator(ParallelState(rank, world, rank, torch.device("cpu"), None, None))


@pytest.mark.parametrize(("vocab", "tp"), [(32003, 4), (32000, 8), (258, 4), (7, 8)])
def test_vocab_shards_cover_vocab_once(vocab, tp):
    shards = [VocabShard(vocab, r, tp) for r in range(tp)]
    assert shards[0].padded_size % tp == 0 and shards[0].padded_size >= vocab
    assert sum(s.real_rows for s in shards) == vocab
    assert [s.start for s in shards] == [r * shards[0].per_rank for r in range(tp)]


@pytest.mark.parametrize(("kv", "tp", "expected"), [
    (8, 2, [(0, 4), (4, 4)]), (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]), (1, 4, [(0, 1)] * 4)])
def test_kv_head_split(kv, tp, expected):
    assert [kv_head_split(kv, r, tp) for r in range(tp)] == expected


def test_rope_llama3_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192, rope_theta=500000.0)
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = inv_frequencies(128, ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": None}).rope)
    torch.testing.assert_close(ours, hf_inv, rtol=0, atol=0)


@pytest.mark.parametrize(("in_rope", "top_level"), [({}, {}), ({"original_max_position_embeddings": 64}, {}),
                                                   ({}, {"original_max_position_embeddings": 32}),
                                                   ({"original_max_position_embeddings": 64},
                                                    {"original_max_position_embeddings": 32})])
def test_rope_llama3_original_context_is_read_as_transformers_reads_it(in_rope, top_level):
    """llama3 rope's pre-training context: a config.json field beside the rope dict wins, then the dict's, and
    without either it is max_position_embeddings (it was 8192, silently another rope than transformers')."""
    import copy

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
               num_hidden_layers=1, vocab_size=10, max_position_embeddings=256, rope_theta=10000.0,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, **in_rope),
               **top_level)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_dict(copy.deepcopy(cfg)), "cpu")  # (it edits cfg)
    ours = inv_frequencies(64, ModelConfig.from_hf_dict(copy.deepcopy(cfg)).rope)
    torch.testing.assert_close(ours, hf_inv, rtol=0, atol=0)


@pytest.mark.parametrize("rope", [dict(factor=4.0, original_max_position_embeddings=4096),
                                  # (factors that are no power of two: 1 / (factor x theta^i) rounds otherwise than
                                  # (1 / theta^i) / factor, and transformers computes the first)
                                  dict(factor=3.0, original_max_position_embeddings=4096),
                                  dict(factor=2.5, original_max_position_embeddings=4096, truncate=False),
                                  dict(factor=16.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2,
                                       attention_factor=1.2, truncate=False),
                                  dict(factor=8.0, original_max_position_embeddings=8192, mscale=0.8,
                                       mscale_all_dim=0.5)])
def test_rope_yarn_matches_transformers_bit_for_bit(rope):
    import copy

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=64,
               num_hidden_layers=1, vocab_size=10, max_position_embeddings=4096 * 16,
               rope_scaling=dict(rope_type="yarn", rope_theta=500000.0, **rope))
    hf_inv, hf_attention = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig.from_dict(copy.deepcopy(cfg)), "cpu")
    ours = ModelConfig.from_hf_dict(copy.deepcopy(cfg)).rope
    torch.testing.assert_close(inv_frequencies(128, ours), hf_inv, rtol=0, atol=0)
    assert ours.attention_factor == hf_attention


def test_a_yarn_rope_with_a_null_factor_derives_it_as_transformers_does():
    """transformers 5 reads a yarn rope's factor null as max_position_embeddings / original_max_position_embeddings
    (the post-YaRN context over the pre-YaRN one); it was refused as missing."""
    import copy

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=64,
               num_hidden_layers=1, vocab_size=10, max_position_embeddings=4096 * 3,
               rope_scaling=dict(rope_type="yarn", rope_theta=500000.0, factor=None,
                                 original_max_position_embeddings=4096))
    hf_inv, hf_attention = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig.from_dict(copy.deepcopy(cfg)), "cpu")
    ours = ModelConfig.from_hf_dict(copy.deepcopy(cfg))
    assert ours.rope.factor == 3.0 and ours.max_context == 4096 * 3
    torch.testing.assert_close(inv_frequencies(128, ours.rope), hf_inv, rtol=0, atol=0)
    assert ours.rope.attention_factor == hf_attention


@pytest.mark.parametrize(("context", "original"), [(4055, 1000), (10000, 3000)])
def test_a_yarn_ropes_derived_factor_gives_the_whole_context(context, original):
    """A null factor derived as max_position_embeddings / original_max_position_embeddings stretches the original
    context to max_position_embeddings: in floating point original x (context / original) can fall short of it (4055
    / 1000 x 1000 = 4054.9999...), and the context was cut to one position less."""
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
               num_hidden_layers=1, vocab_size=10, max_position_embeddings=context,
               rope_scaling=dict(rope_type="yarn", factor=None, original_max_position_embeddings=original))
    assert ModelConfig.from_hf_dict(cfg).max_context == context


class RecordingSource(SafetensorsSource):
    def __init__(self, path):
        super().__init__(path)
        self.reads = []

    def read(self, name, dim, start, length):
        out = super().read(name, dim, start, length)
        self.reads.append((name, out.numel()))
        return out


def test_each_rank_reads_only_its_slices(tmp_path):
    path = make_checkpoint("llama2_vocab32003_sharded", tmp_path / "c")
    cfg = ModelConfig.from_dir(path)
    full = {}
    probe = RecordingSource(path)
    for name in probe.file_of:
        full[name] = int(torch.tensor(probe.shape(name)).prod())
    per_rank = []
    for rank in range(4):
        model = LlamaForCausalLM(cfg, fake_rank(rank, 4), torch.float32, torch.device("cpu"))
        src = RecordingSource(path)
        load_weights(model, src, show_progress=False)
        per_rank.append(src.reads)
    for name, total in full.items():
        sizes = [n for reads in per_rank for (nm, n) in reads if nm == name]
        if "norm" in name:
            assert sizes == [total] * 4  # replicated
        else:
            assert sum(sizes) == total and max(sizes) < total, name  # split, no rank reads it whole


def test_random_weights_are_tp_invariant():
    """Built-in/dummy weights are generated whole per tensor, then sliced: rank 1 of 2 holds the second half."""
    whole = LlamaForCausalLM(BUILTIN_MODEL, fake_rank(0, 1), torch.float32, torch.device("cpu"))
    half = LlamaForCausalLM(BUILTIN_MODEL, fake_rank(1, 2), torch.float32, torch.device("cpu"))
    for m in (whole, half):
        load_weights(m, RandomSource(0, torch.device("cpu")), show_progress=False)
    w, h = whole.layers[0].mlp.down_proj.weight, half.layers[0].mlp.down_proj.weight
    assert torch.equal(h, w[:, w.shape[1] // 2:])
    assert torch.equal(half.norm.weight, whole.norm.weight)


@pytest.mark.parametrize("seed", [2 ** 45, 2 ** 64 - 1, -(2 ** 63)])
def test_random_weights_take_any_64_bit_seed(seed):
    """(seed * 1_000_003 + crc overflowed torch's 64-bit seed past about 2 ** 43: a ValueError at load)"""
    model = LlamaForCausalLM(BUILTIN_MODEL, fake_rank(0, 1), torch.float32, torch.device("cpu"))
    load_weights(model, RandomSource(seed, torch.device("cpu")), show_progress=False)
    assert model.norm.weight.std() > 0


def test_no_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors or PyTorch \\*.bin weights files"):
        SafetensorsSource(tmp_path)


@pytest.mark.parametrize("contents", [b"", b"not a zip or a pickle"])
def test_a_bin_file_that_is_no_pytorch_weights_is_named(tmp_path, contents):
    """(.bin weights load, as vLLM's and transformers': test_hf_checkpoints.py) One that torch cannot read is named,
    not a traceback from torch.load."""
    (tmp_path / "pytorch_model.bin").write_bytes(contents)
    with pytest.raises(CheckpointError, match=r"cannot read .*pytorch_model\.bin as PyTorch weights"):
        SafetensorsSource(tmp_path)
    torch.save({"step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin holds no state dict of tensors"):
        SafetensorsSource(tmp_path)


def test_a_bin_file_runs_no_code_of_its_own(tmp_path):
    """.bin files are unpickled with weights_only, as vLLM's: a pickle that calls a function is refused, not run."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    with (tmp_path / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"model.norm.weight": Payload()}, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"cannot read .*pytorch_model\.bin as PyTorch weights"):
        SafetensorsSource(tmp_path)


def test_the_safetensors_load_format_reads_no_bin_files(tmp_path):
    torch.save({"model.norm.weight": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    assert "model.norm.weight" in SafetensorsSource(tmp_path).file_of
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        SafetensorsSource(tmp_path, pickles=False)


def test_training_files_are_no_bin_weights(tmp_path):
    """A fine-tune's training_args.bin or optimizer.bin are no weights (vLLM passes them over as such): a directory
    with them and no weights was told it held PyTorch .bin weights, and to convert them."""
    for name in ("training_args.bin", "optimizer.bin"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no \\*.safetensors or PyTorch \\*.bin weights files"):
        SafetensorsSource(tmp_path)


def test_a_tensor_read_under_the_base_models_prefix_is_named_as_its_file_holds_it(tmp_path):
    """A checkpoint saved without the "model." prefix is read under it; a tensor of it that cannot load was named
    by the prefixed name, which the file (and its index) does not hold."""
    from safetensors.torch import save_file

    from tpgraph.model.shards import ShardSpec

    save_file({"embed_tokens.weight": torch.zeros(3, 4), "norm.weight": torch.zeros(4, dtype=torch.int8)},
              tmp_path / "model.safetensors")
    source = SafetensorsSource(tmp_path)
    param = torch.nn.Parameter(torch.zeros(5, 4))
    with pytest.raises(CheckpointError, match=r"^tensor 'embed_tokens.weight' \(read as 'model.embed_tokens.weight'\)"
                                              r" in .*model.safetensors has shape \(3, 4\), expected \(5, 4\)"):
        source.read_shard(ShardSpec(param, "model.embed_tokens.weight", (5, 4), 0, 0, 5))
    with pytest.raises(CheckpointError, match=r"^tensor 'norm.weight' \(read as 'model.norm.weight'\) in .* is "
                                              r"stored as I8"):
        source.read_shard(ShardSpec(torch.nn.Parameter(torch.zeros(4)), "model.norm.weight", (4,), 0, 0, 4))


def test_garbage_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        SafetensorsSource(tmp_path)


@pytest.mark.parametrize("index", [b"[1, 2]", b'{"weight_map": ["model-00001.safetensors"]}',
                                   b'{"weight_map": {"lm_head.weight": 3}}', b"\xff\xfe{"])
def test_a_malformed_index_is_named(tmp_path, index):
    """An index that is JSON of another shape, or not text, is a CheckpointError naming it (not a TypeError,
    AttributeError or UnicodeDecodeError from inside the loader)."""
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is malformed"):
        SafetensorsSource(tmp_path)


def test_quantized_weights_are_refused_not_cast(tmp_path):
    """An int8 / fp8 weight read as float without its scales gives wrong outputs silently: refused by name."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("llama32_tied_llama3rope_gqa", tmp_path / "c")
    files = sorted(path.glob("*.safetensors"))
    tensors = load_file(files[0])
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, files[0], metadata={"format": "pt"})
    model = LlamaForCausalLM(ModelConfig.from_dir(path), fake_rank(0, 1), torch.float32, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' .* is stored as I8; .*quantized checkpoints"):
        load_weights(model, SafetensorsSource(path), show_progress=False)


def test_a_tied_config_with_its_own_lm_head_in_the_checkpoint_projects_with_it(tmp_path):
    """transformers 5 ties the output projection to the embedding only where the checkpoint holds no lm_head.weight
    of other values; one it holds is the projection. It was dropped for the embedding: other logits, silently."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM as HFLlama

    from tpgraph.model.loader import load_model

    path = make_checkpoint("llama32_tied_llama3rope_gqa", tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    hf = HFLlama.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, tensors["lm_head.weight"])  # (the reference: transformers projects with it)
    comm = fake_rank(0, 1)
    model = load_model(comm.state, comm, path, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_a_tied_checkpoint_holding_an_equal_lm_head_stays_tied(tmp_path):
    """Checkpoints saved tied often hold the embedding a second time as lm_head.weight: it stays one tensor (it took
    one embedding's memory more, a vocabulary of rows taken from the KV cache)."""
    from safetensors.torch import load_file, save_file

    from tpgraph.model.loader import load_model

    path = make_checkpoint("llama32_tied_llama3rope_gqa", tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    comm = fake_rank(0, 1)
    model = load_model(comm.state, comm, path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_same_values_compares_block_by_block(tmp_path):
    from safetensors.torch import save_file

    a = torch.randn(10, 3)
    b = a.clone()
    b[9, 2] += 1  # (differs only in the last block)
    save_file({"a": a, "a2": a.clone(), "b": b, "c": a[:, :2].contiguous()}, tmp_path / "model.safetensors")
    source = SafetensorsSource(tmp_path)
    assert source.same_values("a", "a2", rows=4)
    assert not source.same_values("a", "b", rows=4)
    assert not source.same_values("a", "c", rows=4)
    assert not source.same_values("a", "absent", rows=4)


def test_eos_ids_outside_the_vocabulary_are_dropped():
    from tpgraph.engine.tp_engine import checked_eos_ids

    assert checked_eos_ids((2, 405, 7), 401) == (2, 7)
    assert checked_eos_ids((), 401) == ()


def test_layers_the_config_leaves_out_are_named(tmp_path, caplog):
    """A config that says fewer layers than the checkpoint holds runs, but not as trained: it is said."""
    import json

    from tpgraph.model.loader import layers_past_the_config

    assert layers_past_the_config(["model.layers.0.mlp.up_proj.weight", "model.layers.3.self_attn.q_proj.weight",
                                   "model.layers.12.input_layernorm.weight", "lm_head.weight"], 2) == [3, 12]
    path = make_checkpoint("llama32_tied_llama3rope_gqa", tmp_path / "c")
    doc = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**doc, "num_hidden_layers": 1}))
    model = LlamaForCausalLM(ModelConfig.from_dir(path), fake_rank(0, 1), torch.float32, torch.device("cpu"))
    with caplog.at_level("WARNING", logger="tpgraph.model.loader"):
        load_weights(model, SafetensorsSource(path), show_progress=False)
    assert "holds layers [1], which config.json's num_hidden_layers (1) leaves out" in caplog.text



def test_tensors_the_model_does_not_read_are_named(tmp_path, caplog):
    """A checkpoint holding tensors config.json does not describe (a q_proj bias where attention_bias is unset, a
    qk-norm weight) ran without them and without a word, not as trained; transformers names them as unexpected keys.
    The rotary buffers older checkpoints saved, and the layers said apart, are not named."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("llama32_tied_llama3rope_gqa", tmp_path / "c")
    cfg = ModelConfig.from_dir(path)

    def warnings_loading() -> str:
        model = LlamaForCausalLM(cfg, fake_rank(0, 1), torch.float32, torch.device("cpu"))
        caplog.clear()
        with caplog.at_level("WARNING", logger="tpgraph.model.loader"):
            load_weights(model, SafetensorsSource(path), show_progress=False)
        return caplog.text

    assert "does not read" not in warnings_loading()
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(cfg.q_size)
    tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(cfg.head_dim)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(cfg.head_dim // 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    text = warnings_loading()
    assert ("the checkpoint holds tensors the model does not read, which are left out (is config.json from the same "
            "checkpoint?): model.layers.0.self_attn.q_proj.bias, model.layers.1.self_attn.q_norm.weight") in text
    assert "inv_freq" not in text


def test_a_tokenizer_saved_with_truncation_or_padding_encodes_whole_prompts_as_transformers_does(tmp_path):
    """A tokenizer.json saved after a call that truncated or padded (as training scripts save it) holds those
    settings; transformers turns them off for a call that asks for none, as vLLM encodes prompts. Read as they were,
    every prompt was cut to their max_length (its end lost) or padded with pad tokens."""
    from tokenizers import Tokenizer
    from tpgtest.chat_fixtures import make_chat_checkpoint
    from transformers import AutoTokenizer

    from tpgraph import TPEngine
    from tpgraph.tokenizer import load_tokenizer

    path = make_chat_checkpoint(tmp_path / "c")
    saved = Tokenizer.from_file(str(path / "tokenizer.json"))
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=8, pad_id=257, pad_token="<|end_of_text|>")
    saved.save(str(path / "tokenizer.json"))
    text = "hello world, a prompt longer than four tokens"
    want = AutoTokenizer.from_pretrained(str(path)).encode(text)
    assert len(want) == len(text)  # (a byte a token: neither cut nor padded)
    assert load_tokenizer(path, 320).encode_batch([text])[0].ids == want
    with TPEngine(path, device="cpu", load_format="dummy", max_num_seqs=2, num_kv_blocks=40) as engine:
        assert engine.encode(text) == want

def test_a_sentencepiece_only_checkpoint_is_refused(tmp_path):
    from tpgraph.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.model").write_bytes(b"sp")
    with pytest.raises(CheckpointError, match="has a tokenizer in tokenizer.model but no tokenizer.json"):
        load_tokenizer(tmp_path, 32000)


@pytest.mark.parametrize("files", [["vocab.json", "merges.txt"], ["tokenizer.model", "vocab.json"]])
def test_a_checkpoint_with_slow_tokenizer_files_only_is_refused_naming_them(tmp_path, files):
    """A byte-level BPE kept as vocab.json + merges.txt (transformers reads them) got the built-in byte tokenizer
    with a warning: every prompt encoded as bytes, garbage ids to the model."""
    from tpgraph.tokenizer import load_tokenizer

    for name in files:
        (tmp_path / name).write_text("{}")
    with pytest.raises(CheckpointError, match=rf"has a tokenizer in {' and '.join(files)} but no tokenizer.json; "
                                              r"write one with transformers"):
        load_tokenizer(tmp_path, 32000)


def test_safetensors_without_a_checkpoint_is_refused():
    from tpgraph.errors import ConfigError
    from tpgraph.model.loader import load_model

    with pytest.raises(ConfigError, match="'safetensors' needs a checkpoint directory"):
        load_model(fake_rank(0, 1).state, fake_rank(0, 1), None, "safetensors")


@pytest.mark.parametrize(("capability", "dtype"), [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                                   ((7, 5), torch.float16)])
def test_a_float32_checkpoint_runs_in_half_precision_on_gpu_as_vllms_auto_dtype(monkeypatch, capability, dtype):
    """vLLM's dtype "auto" downcasts a float32 checkpoint (many fine-tunes save one) to the GPU's preferred half type:
    bf16, or fp16 before sm_80. It ran in fp32: twice the weights' and the KV cache's memory, and other numbers than
    vLLM's. An explicit --dtype float32 still runs fp32 (load_model takes it over this default)."""
    import dataclasses

    from tpgraph.model import loader

    monkeypatch.setattr(loader.torch.cuda, "get_device_capability", lambda device=None: capability)
    for name in ("float32", "fp32", "float"):
        cfg = dataclasses.replace(BUILTIN_MODEL, torch_dtype=name)
        assert loader.default_dtype(cfg, torch.device("cuda")) is dtype
        assert loader.default_dtype(cfg, torch.device("cpu")) is torch.float32



def test_a_bfloat16_checkpoint_runs_in_float16_on_a_gpu_without_bfloat16_as_vllms_auto_dtype(monkeypatch, caplog):
    """Before sm_80 (a T4, a V100) a GPU has no bf16: vLLM's dtype "auto" runs a bf16 checkpoint in fp16 there, with a
    warning. It ran in bf16, which such a GPU does not compute. fp16 checkpoints, and GPUs with bf16, are as before."""
    import dataclasses

    from tpgraph.model import loader

    cuda = torch.device("cuda")
    bf16 = dataclasses.replace(BUILTIN_MODEL, torch_dtype="bfloat16")
    monkeypatch.setattr(loader.torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with caplog.at_level("WARNING", logger="tpgraph.model.loader"):
        assert loader.default_dtype(bf16, cuda) is torch.float16
    assert "has no bfloat16: the bfloat16 checkpoint runs in float16" in caplog.text
    assert loader.default_dtype(dataclasses.replace(BUILTIN_MODEL, torch_dtype="float16"), cuda) is torch.float16
    monkeypatch.setattr(loader.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert loader.default_dtype(bf16, cuda) is torch.bfloat16

def test_the_checkpoint_dtype_is_read_by_every_name_and_an_unknown_one_is_refused(monkeypatch):
    """An unknown torch_dtype ("float8", "float64") was run as bf16 with no word; vLLM's spellings ("half") map."""
    import dataclasses

    from tpgraph.model import loader
    from tpgraph.model.loader import default_dtype

    monkeypatch.setattr(loader.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    for name, dtype in (("half", torch.float16), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        assert default_dtype(dataclasses.replace(BUILTIN_MODEL, torch_dtype=name), cuda) is dtype
    with pytest.raises(ConfigError, match="torch_dtype 'float8' is not a dtype tpgraph runs in .* pass --dtype"):
        default_dtype(dataclasses.replace(BUILTIN_MODEL, torch_dtype="float8"), cuda)
    assert default_dtype(dataclasses.replace(BUILTIN_MODEL, torch_dtype="float8"), torch.device("cpu")) is torch.float32


def test_a_weights_file_that_links_to_nothing_is_named_not_a_traceback(tmp_path):
    """A *.safetensors link whose target is gone (a snapshot copied without its blobs, an unmounted disk) raised a
    bare FileNotFoundError from the loader."""
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot read .*model.safetensors: .*No such file"):
        SafetensorsSource(tmp_path)
