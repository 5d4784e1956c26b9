"""Checkpoints as the hub holds them (config.json variants, file layouts) against transformers' LlamaForCausalLM on the
same weights: tiny random models, run at TP=1 on CPU, compared by their prompt log-probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tpgtest.hf_fixtures import vary

from tpgraph import SamplingParams, TPEngine
from tpgraph.errors import ConfigError

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.1, rms_norm_eps=1e-5)


def save_hf_model(out_dir: Path, **config: object) -> Path:
    """A random transformers LlamaForCausalLM of BASE's shape with `config`'s fields, saved to out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **config})).eval()
    return save_varied(model, out_dir)


def save_varied(model: torch.nn.Module, out_dir: Path) -> Path:
    """model saved to out_dir, its norms and biases varied (hf_fixtures.vary)."""
    vary(model).save_pretrained(out_dir)
    return out_dir


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the ones before it (from the second on), by the
    config's own architecture (AutoModelForCausalLM)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    return [lp[j - 1, prompt[j]].item() for j in range(1, len(prompt))]


def engine_prompt_logprobs(engine: TPEngine, prompt: list[int]) -> list[float]:
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    return [out.prompt_logprobs[j][prompt[j]].logprob for j in range(1, len(prompt))]


def test_a_linear_rope_checkpoint_serves_its_scaled_context_as_transformers_runs_it(tmp_path):
    """A linear rope squeezes positions by its factor: the checkpoint's context is max_position_embeddings times it
    (vicuna-7b-v1.5-16k: 4096 and factor 4, a 16k model), as vLLM derives max_model_len. It was capped at
    max_position_embeddings (a longer max_model_len refused, and the rope tables cut there)."""
    path = save_hf_model(tmp_path / "c", rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0))
    prompt = [(37 * j + 11) % VOCAB for j in range(60)]  # (past max_position_embeddings, within twice it)
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        assert engine.runner.max_model_len == 64
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)
    doc = json.loads((path / "config.json").read_text())
    assert doc["max_position_embeddings"] == 32 and doc["rope_parameters"]["factor"] == 2.0
    with pytest.raises(ConfigError, match=r"max_model_len 65 exceeds the model's context \(max_position_embeddings 32 "
                                          r"x the linear rope factor 2 = 64\)"):
        TPEngine(path, device="cpu", max_model_len=65)


def test_a_max_model_len_past_the_context_runs_where_vllms_variable_allows_it(tmp_path, monkeypatch):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets vLLM serve a max_model_len past max_position_embeddings (the rope goes on
    past it, as transformers' does); it was refused whatever the variable said."""
    path = save_hf_model(tmp_path / "c")
    prompt = [(37 * j + 11) % VOCAB for j in range(40)]  # (past max_position_embeddings, 32)
    want = hf_prompt_logprobs(path, prompt)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4, max_model_len=48) as engine:
        assert engine.runner.max_model_len == 48
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("rope", [
    dict(factor=4.0, original_max_position_embeddings=16),
    dict(factor=4.0, original_max_position_embeddings=16, beta_fast=16, beta_slow=2, attention_factor=1.2,
         truncate=False),
    dict(factor=2.0, original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=0.5),
], ids=["defaults", "betas_attention_factor_untruncated", "mscales"])
def test_a_yarn_rope_checkpoint_runs_as_transformers_runs_it(tmp_path, rope):
    """YaRN (rope_type "yarn": blended frequencies, and cos/sin scaled by its attention factor) was refused; it runs
    now as transformers computes it, over the context vLLM derives (original_max_position_embeddings x factor)."""
    path = save_hf_model(tmp_path / "c", max_position_embeddings=64,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **rope))
    prompt = [(37 * j + 11) % VOCAB for j in range(int(16 * rope["factor"]) - 1)]  # (the context, less a token)
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        assert engine.runner.max_model_len == int(16 * rope["factor"])
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)


def test_a_checkpoint_saved_without_the_model_prefix_loads_as_transformers_loads_it(tmp_path):
    """Weights saved from the base model (embed_tokens.weight, layers.0..., norm.weight: no "model." prefix), which
    transformers' LlamaForCausalLM loads by adding its base model's prefix, were refused as missing
    model.embed_tokens.weight."""
    from safetensors.torch import load_file, save_file

    path = save_hf_model(tmp_path / "c", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)


def test_a_checkpoint_with_some_names_unprefixed_loads_as_transformers_loads_it(tmp_path):
    """transformers adds its base model's prefix to each name the model holds under it, one name at a time: a
    checkpoint whose embedding alone is saved without "model." (its layers, norm and lm_head with their usual names)
    loads. Only a checkpoint with no prefixed name at all was read so; this one was refused as missing
    model.embed_tokens.weight, which it holds."""
    from safetensors.torch import load_file, save_file

    path = save_hf_model(tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" in tensors
    tensors["embed_tokens.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)


def hf_greedy(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy continuation (AutoModelForCausalLM: the config's architecture)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine_greedy(engine: TPEngine, prompt: list[int], steps: int) -> list[int]:
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))[0]
    return list(out.outputs[0].token_ids)


def test_a_llama_checkpoint_with_attention_and_mlp_biases_runs_as_transformers_runs_it(tmp_path):
    """attention_bias (q, k, v and o) and mlp_bias (gate, up and down), as transformers' LlamaForCausalLM builds them
    (they were refused): the prompt's log-probabilities and the greedy decode match, the decode steps included."""
    path = save_hf_model(tmp_path / "c", attention_bias=True, mlp_bias=True, num_key_value_heads=1)
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        assert engine_prompt_logprobs(engine, prompt) == pytest.approx(want, abs=1e-4)
        assert engine_greedy(engine, prompt, 8) == hf_greedy(path, prompt, 8)
    # the biases are read, not zeros: without them the same weights give other log-probabilities
    doc = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**doc, "attention_bias": False, "mlp_bias": False}))
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        assert engine_prompt_logprobs(engine, prompt) != pytest.approx(want, abs=1e-3)


def test_a_qwen2_checkpoint_runs_as_transformers_runs_it(tmp_path):
    """Qwen2ForCausalLM (Qwen2 and Qwen2.5) is a Llama with biases on q, k and v: it was refused as an unsupported
    architecture. Its config names a window it does not use (use_sliding_window false), tied embeddings here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**BASE, "max_position_embeddings": 64}, tie_word_embeddings=True, sliding_window=16,
                         use_sliding_window=False, max_window_layers=1, rope_theta=1e6)
    path = save_varied(Qwen2ForCausalLM(config).eval(), tmp_path / "c")
    doc = json.loads((path / "config.json").read_text())
    assert doc["architectures"] == ["Qwen2ForCausalLM"] and doc["model_type"] == "qwen2"
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]  # (past the window it names)
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        assert engine.runner.max_model_len == 64
        assert engine_prompt_logprobs(engine, prompt) == pytest.approx(want, abs=1e-4)
        assert engine_greedy(engine, prompt, 8) == hf_greedy(path, prompt, 8)


@pytest.mark.parametrize("bias", [False, True])
def test_a_qwen3_checkpoint_runs_as_transformers_runs_it(tmp_path, bias):
    """Qwen3ForCausalLM (Qwen3's dense models): a Llama with an RMSNorm over each head of q and k before the rotation,
    and attention_bias on q, k, v and o; it was refused as an unsupported architecture."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**{**BASE, "max_position_embeddings": 64}, head_dim=32, attention_bias=bias,
                         tie_word_embeddings=True, rope_theta=1e6)
    path = save_varied(Qwen3ForCausalLM(config).eval(), tmp_path / "c")
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        assert engine_prompt_logprobs(engine, prompt) == pytest.approx(want, abs=1e-4)
        assert engine_greedy(engine, prompt, 8) == hf_greedy(path, prompt, 8)


def test_a_checkpoint_whose_config_asks_for_biases_it_lacks_is_refused_naming_one(tmp_path):
    path = save_hf_model(tmp_path / "c")
    doc = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**doc, "mlp_bias": True}))
    from tpgraph.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.gate_proj.bias' is missing"):
        TPEngine(path, device="cpu")


def test_a_mistral_checkpoint_without_a_sliding_window_runs_as_transformers_runs_it(tmp_path):
    """MistralForCausalLM (model_type mistral: Mistral-7B-Instruct-v0.2 and v0.3, sliding_window null) is Llama's
    model, which vLLM serves with its Llama code; it was refused as an unsupported architecture."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**BASE, sliding_window=None, head_dim=32)).eval()
    model.save_pretrained(tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "config.json").read_text())
    assert doc["architectures"] == ["MistralForCausalLM"] and doc["model_type"] == "mistral"
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]
    want = hf_prompt_logprobs(tmp_path / "c", prompt)
    with TPEngine(tmp_path / "c", device="cpu", max_num_seqs=2, block_size=4) as engine:
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)


def test_a_sliding_window_checkpoint_runs_capped_at_its_window_under_vllms_disable_sliding_window(tmp_path):
    """vLLM's --disable-sliding-window (disable_sliding_window=True) runs a sliding-window checkpoint (Mistral-7B-v0.1,
    zephyr-7b-beta: a window of 4096) with full attention over a context capped at the window, the same attention as
    the window's; the flag was unknown, and such a checkpoint refused whatever the user gave."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**{**BASE, "max_position_embeddings": 64}, sliding_window=16)).eval() \
        .save_pretrained(tmp_path / "c")
    prompt = [(37 * j + 11) % VOCAB for j in range(15)]  # (the window, less the token it leaves room for)
    want = hf_prompt_logprobs(tmp_path / "c", prompt)
    with pytest.raises(ConfigError, match="config.json sets sliding_window=16, .* disable_sliding_window "
                                          r"\(--disable-sliding-window\) runs it"):
        TPEngine(tmp_path / "c", device="cpu")
    with TPEngine(tmp_path / "c", device="cpu", max_num_seqs=2, block_size=4, disable_sliding_window=True) as engine:
        assert engine.runner.max_model_len == 16
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)
    with pytest.raises(ConfigError, match=r"max_model_len 17 exceeds the model's sliding window \(16\), which "
                                          r"disable_sliding_window caps its context at"):
        TPEngine(tmp_path / "c", device="cpu", disable_sliding_window=True, max_model_len=17)


@pytest.mark.parametrize("layout", ["one_file", "sharded", "legacy_format"])
def test_a_pytorch_bin_checkpoint_loads_as_vllm_and_transformers_load_it(tmp_path, layout):
    """A checkpoint of PyTorch .bin weights (pytorch_model.bin, or shards with their index: older fine-tunes ship only
    these), which vLLM's "auto" load format and transformers load where there are no safetensors, was refused."""
    from safetensors.torch import load_file

    path = save_hf_model(tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    if layout == "sharded":
        names = sorted(tensors)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for fname, part in shards.items():
            torch.save({n: tensors[n] for n in part}, path / fname)
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    else:
        torch.save(tensors, path / "pytorch_model.bin", _use_new_zipfile_serialization=layout == "one_file")
    (path / "training_args.bin").write_bytes(b"")  # (a trainer's, beside the weights: passed over)
    prompt = [(37 * j + 11) % VOCAB for j in range(20)]
    want = hf_prompt_logprobs(path, prompt)
    with TPEngine(path, device="cpu", max_num_seqs=2, block_size=4) as engine:
        got = engine_prompt_logprobs(engine, prompt)
    assert got == pytest.approx(want, abs=1e-4)
